"""The sweep's tuning stage (raysim/tuning.py, issue 72): every algorithm tuned on held-out
training samples, the choice appended to its runs."""
import csv
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysim.errors import ConfigError
from raysim.tuning import choose, score


def write_idx(path: Path, arr: np.ndarray) -> None:
    path.write_bytes(struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
                     + arr.astype(np.uint8).tobytes())


def mnist_whose_test_labels_disagree(root: Path) -> None:
    """MNIST's files with learnable images (class c: a bright block at its own place), and a
    test set whose labels are shifted by one: a model that learns the training data scores
    ~0 there, one that learns nothing ~10 %. Validation and test then disagree."""
    rng = np.random.default_rng(0)

    def images(y):
        x = rng.integers(0, 60, (len(y), 28, 28))
        for i, c in enumerate(y):
            r, q = divmod(int(c), 5)
            x[i, 4 + 10 * r:10 + 10 * r, 2 + 5 * q:6 + 5 * q] = 255
        return x

    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    y_train, y_test = rng.integers(0, 10, 600), rng.integers(0, 10, 200)
    write_idx(raw / "train-images-idx3-ubyte", images(y_train))
    write_idx(raw / "train-labels-idx1-ubyte", y_train)
    write_idx(raw / "t10k-images-idx3-ubyte", images(y_test))
    write_idx(raw / "t10k-labels-idx1-ubyte", (y_test + 1) % 10)


def test_choose_takes_the_best_score_never_a_failed_run_and_the_first_on_a_tie():
    assert choose({"lr=0.01": 0.5, "lr=0.1": 0.7, "lr=1": None}) == "lr=0.1"
    assert choose({"a": 0.6, "b": 0.6}) == "a"
    assert choose({"a": None}) is None


def test_a_run_whose_model_is_made_after_the_last_round_is_scored_by_that_model(tmp_path):
    """CCVR reports its calibrated model, made after the rounds; its tuning judged the rounds'
    evaluations (FedAvg's model), so its score equalled FedAvg's to every digit."""
    import pyarrow as pa

    run = tmp_path / "run"
    run.mkdir()
    pq.write_table(pa.table({"round": [1, 2, 3], "accuracy": [0.5, 0.6, 0.7], "local_accuracy": [0.5, 0.6, 0.7],
                             "per_class_accuracy": [[0.5, 0.5, 0.0]] * 3}), run / "metrics.parquet")
    (run / "summary.json").write_text(json.dumps({
        "status": "finished", "final_accuracy": 0.8, "final_local_accuracy": 0.75, "test_class_counts": [5, 3, 0],
        "after_training": {"calibrated": {"accuracy": 0.8, "per_class_accuracy": [0.9, 0.6, 0.0]}}}))
    assert score(run, "global", 3) == 0.8 and score(run, "own", 3) == 0.75
    assert score(run, "balanced", 3) == pytest.approx(0.75)  # classes 0 and 1, the ones the set holds
    summary = json.loads((run / "summary.json").read_text())
    del summary["after_training"]
    (run / "summary.json").write_text(json.dumps(summary))
    assert score(run, "global", 2) == pytest.approx(0.65) and score(run, "balanced", 3) == pytest.approx(0.5)


def test_the_choice_follows_validation_where_the_test_set_would_choose_otherwise(ray_local, tmp_path):
    from raysim.run import main as run
    from raysim.sweep import main as sweep

    mnist_whose_test_labels_disagree(tmp_path / "data")
    fixed = {"dataset": "mnist", "data_dir": str(tmp_path / "data"), "download": False, "model": "mclr",
             "rounds": 3, "num_clients": 4, "participation": 1.0, "local": {"epochs": 1}}
    (tmp_path / "s.yaml").write_text(json.dumps({
        "name": "t", "fixed": fixed, "grid": {"seed": [0], "algorithm": ["fedavg"]},
        "tune": {"seed": 0, "validation": 0.25, "last": 2, "judge": "global", "grid": {"local.lr": [0.00001, 0.1]}}}))
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / "t"
    rows = list(csv.DictReader((out / "tuning.csv").open()))
    by_point = {r["point"]: r for r in rows}
    assert set(by_point) == {"lr=1e-05", "lr=0.1"}
    for point, row in by_point.items():  # each score: the tuning run's last 2 evaluations, on validation samples
        run_dir = out / "tuning" / f"seed=0,algorithm=fedavg,{point}"
        assert "validation: 0.25" in (run_dir / "config.yaml").read_text()
        assert float(row["score"]) == pytest.approx(score(run_dir, "global", 2))
        acc = pq.read_table(run_dir / "metrics.parquet").column("accuracy").to_pylist()
        assert float(row["score"]) == pytest.approx(np.mean([a for a in acc if a is not None][-2:]))
    assert by_point["lr=0.1"]["chosen"] == "1" and float(by_point["lr=0.1"]["score"]) > 0.5
    run_dir = out / "tuning" / "seed=0,algorithm=fedavg,lr=0.1"  # balanced: per-class accuracy over the classes held
    counts = json.loads((run_dir / "summary.json").read_text())["test_class_counts"]
    per_class = [r for r in pq.read_table(run_dir / "metrics.parquet").column("per_class_accuracy").to_pylist() if r]
    held = [c for c, n in enumerate(counts) if n]
    assert 140 < sum(counts) <= 150 and score(run_dir, "balanced", 2) == pytest.approx(
        np.mean([np.mean([r[c] for c in held]) for r in per_class[-2:]]))
    # the sweep again: its finished point holds the tuned lr, which the plan made before the tuning
    # stage lacks; it is checked against the tuned config, and nothing runs again
    done = (out / "seed=0,algorithm=fedavg" / "summary.json").stat().st_mtime_ns
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]) == 0
    assert (out / "seed=0,algorithm=fedavg" / "summary.json").stat().st_mtime_ns == done
    # the same rows from the run folders alone (a stage stopped part way)
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out"),
                  "--record-tuning", str(tmp_path / "again.csv")]) == 0
    assert list(csv.DictReader((tmp_path / "again.csv").open())) == sorted(rows, key=lambda r: r["point"])
    final = (out / "seed=0,algorithm=fedavg" / "config.yaml").read_text()
    assert "lr: 0.1" in final and "validation: 0.0" in final  # the chosen lr, judged on the test set again
    test_scores = {}
    for lr in (0.00001, 0.1):  # the same two points judged by the test set
        assert run(["dataset=mnist", f"data_dir={tmp_path / 'data'}", "download=false", "model=mclr", "rounds=3",
                    "num_clients=4", "participation=1.0", "local.epochs=1", f"local.lr={lr}", "--quiet",
                    f"output_dir={tmp_path / 'test'}", f"run_name=lr{lr}"]) == 0
        test_scores[lr] = score(tmp_path / "test" / f"lr{lr}", "global", 2)
    assert test_scores[0.00001] > test_scores[0.1]  # the test set would have chosen the other lr


@pytest.mark.parametrize("tune,says", [
    ({"validation": 1.0}, "tune.validation must be in (0, 1)"),
    ({"judge": "best"}, "tune judge 'best': allowed own, global, balanced"),
    ({"by_algorithm": {"fedfoo": {"x.y": [1]}}}, "tune.by_algorithm names 'fedfoo', not an algorithm of the grid"),
    ({"seed": 7}, "tune.seed=7 is not a value of grid.seed"),
    ({"lr": [1]}, "tune has unknown key(s) lr"),
    # a tuning point's unknown key: refused before the sweep's folder is made (it was left behind, empty)
    ({"otherwise": {"local.epoch": [1, 2]}}, "unknown config key 'local.epoch'"),
])
def test_a_bad_tune_section_is_refused_in_one_line(tmp_path, capfd, tune, says):
    from raysim.sweep import main as sweep

    (tmp_path / "s.yaml").write_text(json.dumps({"grid": {"seed": [0], "algorithm": ["fedavg"]}, "tune": tune}))
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_tuning_leaves_out_the_points_the_sweep_file_skips(tmp_path):
    """A combination that cannot run (the sweep file's `skip`, e.g. Fed2's VGG on vectors) is
    never planned for tuning either (its config would be refused)."""
    from raysim.sweep import parse, plan_tuning, read_skip, read_tune

    f = tmp_path / "s.yaml"
    f.write_text(json.dumps({"grid": {"seed": [0], "setting": [{"label": "digits", "dataset": "digits"},
                                                               {"label": "syn", "dataset": "synthetic"}],
                                      "algorithm": ["fedavg", {"label": "fed2", "algorithm": "fed2", "model": "vgg9"}]},
                             "skip": [{"setting": "syn", "algorithm": "fed2"}], "tune": {"grid": {"local.lr": [0.1]}}}))
    _, files, fixed, grid = parse([], f)
    cells = {(s, a) for s in ("digits", "syn") for a in ("fedavg", "fed2")}
    points = plan_tuning(files, fixed, grid, tmp_path / "out", read_tune(f, grid), cells, read_skip(f, grid))
    assert sorted(p["cell"] for p in points) == [("digits", "fed2"), ("digits", "fedavg"), ("syn", "fedavg")]


def test_only_runs_a_setting_for_the_listed_algorithms_and_refuses_a_name_not_in_the_grid(tmp_path):
    """`only: [{setting: lt, algorithm: [fedavg, creff]}]`: the long-tailed setting runs those
    two (a setting cut to the methods its claim is about); the others run everything."""
    from raysim.sweep import parse, plan, read_skip

    f = tmp_path / "s.yaml"
    spec = {"grid": {"seed": [0], "setting": [{"label": "digits", "dataset": "digits"},
                                              {"label": "lt", "dataset": "digits", "long_tail": {"imbalance": 10}}],
                     "algorithm": ["fedavg", "fedprox", "creff"]},
            "only": [{"setting": "lt", "algorithm": ["fedavg", "creff"]}]}
    f.write_text(json.dumps(spec))
    _, files, fixed, grid = parse([], f)
    points = plan(files, fixed, grid, tmp_path / "out", skip=read_skip(f, grid))
    assert sorted(Path(p["run_dir"]).name for p in points) == sorted(
        [f"seed=0,setting=digits,algorithm={a}" for a in ("fedavg", "fedprox", "creff")]
        + ["seed=0,setting=lt,algorithm=fedavg", "seed=0,setting=lt,algorithm=creff"])
    f.write_text(json.dumps({**spec, "only": [{"setting": "lt", "algorithm": ["fedavg", "scafold"]}]}))
    with pytest.raises(ConfigError, match="only's algorithm=scafold is none of grid.algorithm's values"):
        read_skip(f, grid)


def test_cells_set_a_key_for_the_named_cells_only_the_command_line_wins_and_a_wrong_name_is_refused(tmp_path):
    """`cells: [{setting: long, algorithm: [fedconcat], set: {fedconcat.encoder_rounds: 30}}]`: an
    option only that algorithm reads, at a value only that setting's rounds allow; the tuning
    points of the cell get it too, and a one-value key on the command line wins over it."""
    from raysim.config import read_layers, resolve
    from raysim.sweep import parse, plan, plan_tuning, read_cells, read_skip, read_tune

    f = tmp_path / "s.yaml"
    spec = {"grid": {"seed": [0], "setting": [{"label": "short", "dataset": "digits", "rounds": 25},
                                              {"label": "long", "dataset": "digits", "rounds": 40}],
                     "algorithm": ["fedavg", "fedconcat"]},
            "cells": [{"setting": "long", "algorithm": ["fedconcat"], "set": {"fedconcat": {"encoder_rounds": 30}}}],
            "tune": {"grid": {"local.lr": [0.1]}}}
    f.write_text(json.dumps(spec))
    _, files, fixed, grid = parse([], f)
    cells = read_cells(f, grid)
    rounds = lambda p: resolve(read_layers(files, p["overrides"])).fedconcat.encoder_rounds  # noqa: E731
    points = {Path(p["run_dir"]).name: p for p in plan(files, fixed, grid, tmp_path / "out", per_cell=cells)}
    assert rounds(points["seed=0,setting=long,algorithm=fedconcat"]) == 30
    assert rounds(points["seed=0,setting=short,algorithm=fedconcat"]) == 20  # the preset's (30 would be refused)
    assert not any("encoder_rounds" in o for p in points.values() if "fedavg" in p["name"] for o in p["overrides"])
    tuning = plan_tuning(files, fixed, grid, tmp_path / "out", read_tune(f, grid), {("long", "fedconcat")},
                         read_skip(f, grid), cells)
    assert [rounds(p) for p in tuning] == [30]
    assert read_cells(f, grid, given=["fedconcat.encoder_rounds"])[0]["set"] == []
    f.write_text(json.dumps({**spec, "cells": [{"setting": "lng", "set": {"rounds": 3}}]}))
    with pytest.raises(ConfigError, match="cells' setting=lng is none of grid.setting's values"):
        read_cells(f, grid)
    f.write_text(json.dumps({**spec, "cells": [{"setting": "long"}]}))
    with pytest.raises(ConfigError, match="cells must be a list of mappings"):
        read_cells(f, grid)


def test_a_tuning_point_that_diverges_is_a_result_never_chosen_and_the_sweep_goes_on(ray_local, tmp_path):
    """On Ray Tune (a number of actors): a trial's diverged run comes back as its result's error."""
    from raysim.sweep import main as sweep

    (tmp_path / "s.yaml").write_text(json.dumps({
        "name": "d", "fixed": {"rounds": 2, "num_clients": 4, "participation": 1.0, "local": {"epochs": 1},
                               "resources": {"num_actors": 1}},
        "grid": {"seed": [0], "algorithm": ["fedavg"]},
        "tune": {"grid": {"local.lr": [1e30, 0.1]}, "last": 1, "judge": "global"}}))
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]) == 0
    rows = {r["point"]: r for r in csv.DictReader((tmp_path / "out" / "d" / "tuning.csv").open())}
    assert rows["lr=1e+30"]["score"] == "" and rows["lr=0.1"]["chosen"] == "1"
    assert (tmp_path / "out" / "d" / "seed=0,algorithm=fedavg" / "summary.json").is_file()


def test_a_sweep_resumed_for_a_new_cell_checks_a_finished_cell_with_its_tuned_values(ray_local, tmp_path):
    """One cell finished with a tuned lr, another still to run: the resumed sweep reads the finished
    cell's choice back from its tuning runs (it was refused as 'another config', the default lr)."""
    from raysim.sweep import main as sweep

    (tmp_path / "s.yaml").write_text(json.dumps({
        "name": "r", "fixed": {"rounds": 1, "num_clients": 4, "participation": 1.0, "local": {"epochs": 1}},
        "grid": {"seed": [0], "algorithm": ["fedavg", "fedprox"]},
        "tune": {"grid": {"local.lr": [0.2, 0.5]}, "last": 1, "judge": "global"}}))
    args = ["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]
    assert sweep([*args, "algorithm=fedavg"]) == 0
    out = tmp_path / "out" / "r"
    done = (out / "seed=0,algorithm=fedavg" / "summary.json").stat().st_mtime_ns
    import yaml

    assert yaml.safe_load((out / "seed=0,algorithm=fedavg" / "config.yaml").read_text())["local"]["lr"] in (0.2, 0.5)
    assert sweep(args) == 0  # fedprox tuned and run; fedavg's finished point left as it is
    assert (out / "seed=0,algorithm=fedavg" / "summary.json").stat().st_mtime_ns == done
    assert (out / "seed=0,algorithm=fedprox" / "summary.json").is_file()
    rows = list(csv.DictReader((out / "tuning.csv").open()))
    assert sorted({r["algorithm"] for r in rows}) == ["fedavg", "fedprox"]
    assert sum(r["chosen"] == "1" for r in rows) == 2


def test_a_choice_at_a_grids_edge_gets_one_more_point_past_it():
    """Issue 84: 99 of the table's 140 choices sat at the lr grid's top. `tune.extend` adds the
    point one step past the edge the choice sits on (the axis's last ratio), the other axes at
    the choice; an inner choice, or an axis holding a non-number, adds nothing."""
    from raysim.tuning import Tuning

    t = Tuning(grid={"local.lr": [0.01, 0.03, 0.1]}, extend=1,
               by_algorithm={"fedprox": {"fedprox.mu": [0.001, 0.01, 0.1]}, "perfedavg": {"perfedavg.beta": [0.001, None]}})
    assert t.beyond("fedavg", ["local.lr=0.1"], []) == [["local.lr=0.333333"]]
    assert t.beyond("fedavg", ["local.lr=0.01"], []) == [["local.lr=0.00333333"]]
    assert t.beyond("fedavg", ["local.lr=0.03"], []) == []
    assert t.beyond("fedprox", ["local.lr=0.1", "fedprox.mu=0.001"], []) == [
        ["local.lr=0.333333", "fedprox.mu=0.001"], ["local.lr=0.1", "fedprox.mu=0.0001"]]
    assert t.beyond("fedavg", ["local.lr=0.333333"], [["local.lr=0.333333"]]) == [["local.lr=1.11111"]]
    assert t.beyond("perfedavg", ["local.lr=0.03", "perfedavg.beta=null"], []) == []


def test_a_method_without_a_key_of_its_own_tunes_the_otherwise_axes_and_a_count_grows_whole():
    """Issue 84: FedAvg and 19 others got 3 points (lr only) against the others' 9. `otherwise`
    gives a method with no by_algorithm entry a second axis (FedAvg's local epochs); past an
    edge a whole-number axis grows by a whole number (10 * 10 / 5 = 20; 2 * 2 / 5 = 0.8 -> 1)."""
    from raysim.tuning import Tuning

    t = Tuning(grid={"local.lr": [0.01, 0.1]}, otherwise={"local.epochs": [2, 5, 10]},
               by_algorithm={"fedprox": {"fedprox.mu": [0.001, 0.01, 0.1]}})
    assert t.combos("fedavg") == [[f"local.lr={lr}", f"local.epochs={e}"] for lr in (0.01, 0.1) for e in (2, 5, 10)]
    assert t.combos("fedprox")[0] == ["local.lr=0.01", "fedprox.mu=0.001"] and len(t.combos("fedprox")) == 6
    assert t.beyond("fedavg", ["local.lr=0.01", "local.epochs=10"], []) == [
        ["local.lr=0.001", "local.epochs=10"], ["local.lr=0.01", "local.epochs=20"]]
    assert t.beyond("fedavg", ["local.lr=0.01", "local.epochs=2"], [])[1] == ["local.lr=0.01", "local.epochs=1"]
    # at 1 the next step down rounds to 1 again: nothing more to add
    assert t.beyond("fedavg", ["local.lr=0.05", "local.epochs=1"], [["local.lr=0.05", "local.epochs=1"]]) == []


def test_the_results_table_tunes_every_method_on_as_many_points():
    """Issue 84's "done when": every method of configs/sweeps/results_table.yaml tuned on as many
    points as any other (9), but the one row fixed at one lr on purpose (fedavg_lr001); and a
    choice at an edge gets a point past it."""
    from raysim.sweep import _label, parse, read_tune

    file = Path(__file__).resolve().parents[1] / "configs" / "sweeps" / "results_table.yaml"
    grid = parse([], file)[3]
    tuning = read_tune(file, grid)
    algorithms = [_label(v) or v for v in grid["algorithm"]]
    assert "fedavg" in algorithms and "fedentopt" in algorithms
    counts = {a: len(tuning.combos(a)) for a in algorithms}
    assert {a: n for a, n in counts.items() if n != 9} == {"fedavg_lr001": 1}, counts
    assert tuning.extend >= 1


def test_the_sweep_runs_the_point_past_the_edge_and_chooses_among_all(ray_local, tmp_path, capsys):
    from raysim.sweep import main as sweep

    (tmp_path / "s.yaml").write_text(json.dumps({
        "name": "e", "fixed": {"rounds": 2, "num_clients": 4, "participation": 1.0, "local": {"epochs": 1}},
        "grid": {"seed": [0], "algorithm": ["fedavg"]},
        "tune": {"grid": {"local.lr": [0.0001, 0.001]}, "last": 1, "judge": "global", "extend": 1},
        "processes": 2}))  # every stage in two processes (sweep_pool.py), as the results table's sweep
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]) == 0
    assert "running 2 point(s) in 2 processes of this machine" in capsys.readouterr().out  # the tuning stage's too
    rows = {r["point"]: r for r in csv.DictReader((tmp_path / "out" / "e" / "tuning.csv").open())}
    # two rounds at lr 1e-4 or 1e-3 barely move a model: the top wins and lr 0.01 is run past it, and wins
    assert set(rows) == {"lr=0.0001", "lr=0.001", "lr=0.01"} and rows["lr=0.01"]["chosen"] == "1", rows
    import yaml

    saved = yaml.safe_load((tmp_path / "out" / "e" / "seed=0,algorithm=fedavg" / "config.yaml").read_text())
    assert saved["local"]["lr"] == 0.01
    # resumed with its point to run again: the point past the edge is found again from the scores
    # of the finished tuning runs, and none of them runs twice
    import shutil

    again = tmp_path / "out" / "e" / "tuning" / "seed=0,algorithm=fedavg,lr=0.01" / "summary.json"
    when = again.stat().st_mtime_ns
    shutil.rmtree(tmp_path / "out" / "e" / "seed=0,algorithm=fedavg")
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path / "out")]) == 0
    assert again.stat().st_mtime_ns == when
    saved = yaml.safe_load((tmp_path / "out" / "e" / "seed=0,algorithm=fedavg" / "config.yaml").read_text())
    assert saved["local"]["lr"] == 0.01
