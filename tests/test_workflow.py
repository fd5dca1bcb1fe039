"""The researcher workflow (issue 15): partition pictures, plots, tables, sweeps."""
import json

import numpy as np
import pytest

from raysim.run import main


def test_the_partition_picture_for_one_class_per_client_is_drawn(tmp_path, capfd):
    from raysim.config import load_config
    from raysim.data.partition import label_counts
    from raysim.experiment import prepare

    for suffix in ("png", "svg"):
        out = tmp_path / f"part.{suffix}"
        assert main(["--show-partition", "partition=classes", "partition.k=1", "--plot", str(out), "--quiet"]) == 0
        data = out.read_bytes()
        assert len(data) > 10_000
        assert data[:8] == b"\x89PNG\r\n\x1a\n" if suffix == "png" else b"<svg" in data[:2000]
    data, part, n = prepare(load_config(overrides=["partition=classes", "partition.k=1"]))
    counts = label_counts(data.y_train, part, n)  # what the picture draws: one label per client
    assert ((counts > 0).sum(1) == 1).all()


@pytest.mark.parametrize("args, says", [
    (["--show-partition", "--plot", "p.jpg"], "--plot p.jpg: the file must end in .png or .svg"),
    (["--plot", "p.png"], "--plot FILE draws the partition: give it with --show-partition"),
])
def test_a_bad_plot_request_gets_one_line(tmp_path, capfd, args, says):
    assert main([*args, "--quiet"]) == 2
    err = capfd.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def four_runs(ray_local, tmp_path_factory):
    """2 algorithms x 2 seeds of a tiny problem, as run directories under one folder."""
    root = tmp_path_factory.mktemp("runs")
    for algorithm in ("fedavg", "fedprox"):
        for seed in (0, 1):
            assert main([f"algorithm={algorithm}", f"seed={seed}", "model=mclr", "rounds=3", "num_clients=6",
                         f"output_dir={root}", f"run_name={algorithm}-{seed}", "--quiet"]) == 0
    return root


def test_the_table_cells_are_the_mean_and_std_of_the_runs_summaries(four_runs, capsys):
    import json
    import statistics

    from raysim.results.table import main as table

    assert table([str(four_runs), "--cols", "algorithm", "--rows", "dataset", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "dataset,fedavg,fedprox" and lines[1].startswith("digits,")
    for algorithm, cell in zip(("fedavg", "fedprox"), lines[1].split(",")[1:]):
        values = [100 * json.loads((four_runs / f"{algorithm}-{s}" / "summary.json").read_text())["final_accuracy"]
                  for s in (0, 1)]
        assert cell == f"{statistics.mean(values):.1f} +- {statistics.stdev(values):.1f}"
    assert table([str(four_runs), "--metric", "accuracy@2", "--format", "latex"]) == 0
    out = capsys.readouterr().out
    assert r"\begin{tabular}" in out and r"$\pm$" in out


def test_a_table_over_an_unknown_key_or_metric_says_which(four_runs, capfd):
    from raysim.results.table import main as table

    assert table([str(four_runs), "--rows", "partition.betta"]) == 2
    assert "'partition.betta' is not a config key of these runs; did you mean partition.beta" in capfd.readouterr().err
    assert table([str(four_runs), "--metric", "final_acc"]) == 2
    assert "--metric final_acc: no run has it" in capfd.readouterr().err


def test_plots_are_valid_png_and_svg_with_one_line_per_algorithm(four_runs, tmp_path):
    from raysim.results.plot import main as plot, series

    lines = series([four_runs], "accuracy", "round")
    assert sorted(s["label"] for s in lines) == ["algorithm=fedavg (2 seeds)", "algorithm=fedprox (2 seeds)"]
    assert all(len(s["x"]) == 3 and s["low"] is not None for s in lines)
    for fmt in ("png", "svg"):
        assert plot([str(four_runs), "--x", "round", "bytes", "seconds", "--out", str(tmp_path / "p"),
                     "--format", fmt]) == 0
        for axis in ("round", "bytes", "seconds"):
            data = (tmp_path / f"p_{axis}.{fmt}").read_bytes()
            assert len(data) > 10_000 and (data[:4] == b"\x89PNG" if fmt == "png" else b"<svg" in data[:2000])


SWEEP = ["seed=0,1", "algorithm=fedavg", "model=mclr", "rounds=2", "num_clients=6"]


@pytest.mark.parametrize("where, extra", [("one after another in this process", []),
                                          ("on Ray Tune", ["resources.num_actors=1"]),
                                          ("in 2 processes of this machine", ["--processes", "2"])])
def test_a_sweep_interrupted_in_its_second_point_keeps_the_first_and_resumes_the_second(tmp_path, where, extra):
    """A 2-point sweep in its own process, Ctrl-C once the second point wrote a checkpoint:
    exit 130 with the points done and how to finish; the rerun leaves the first alone, resumes
    the second from its checkpoint, and the table's cells are the runs' summaries. Its points
    run one after another in the sweep's process when none asks for Ray (sweep.run_here), as
    Tune trials when they do (a number of actors), at once in spawned processes with
    --processes 2 (sweep_pool.py: the signal reaches the point in hand there)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from raysim.results.table import main as table

    args = [sys.executable, "-m", "raysim.sweep", "rounds=2,100", "algorithm=fedavg", "model=mclr", "num_clients=6",
            "checkpoint_every=5", *extra, "--output-dir", str(tmp_path), "--name", "s"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    first, second = tmp_path / "s" / "rounds=2", tmp_path / "s" / "rounds=100"
    deadline = time.time() + 240
    # on Tune the two points run at once (1 actor each, 2 CPUs): the first may end after the second's checkpoint
    while not ((first / "summary.json").exists() and (second / "checkpoint.pt").exists()) \
            and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert (first / "summary.json").exists() and (second / "checkpoint.pt").exists(), p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert f"running 2 point(s) {where}" in out
    # Tune stops a trial some seconds after Ctrl-C (~10 s seen): its short point may finish first
    stopped = where != "on Ray Tune" or not (second / "summary.json").exists()
    if stopped:
        assert p.returncode == 130, err[-2000:]
        assert "sweep interrupted: 1 of 2 points done; rerun the same command to finish" in err
        assert not (second / "summary.json").exists()
    stamp = (first / "summary.json").stat().st_mtime_ns
    if where == "on Ray Tune":  # the rerun in processes (as the results table's sweep): a point begun with a client
        # actor resumes with none (its recorded resources.num_actors overridden: it failed, no Ray to start)
        args = [a for a in args if a != "resources.num_actors=1"] + ["--processes", "2"]
    r = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"2 points, {1 if stopped else 2} done, {1 if stopped else 0} to run" in r.stdout
    assert (first / "summary.json").stat().st_mtime_ns == stamp  # the finished point was not run again
    if stopped:
        assert "checkpoint of round" in (second / "log.txt").read_text()  # resumed, not started again
    from raysim.run import main as run  # the first point alone, as a command: the same model either way

    assert run(["rounds=2", "algorithm=fedavg", "model=mclr", "num_clients=6", f"output_dir={tmp_path}",
                "run_name=alone", "--quiet"]) == 0
    alone = json.loads((tmp_path / "alone" / "summary.json").read_text())
    assert alone["model_sha256"] == json.loads((first / "summary.json").read_text())["model_sha256"]
    assert json.loads((second / "summary.json").read_text())["rounds"] == 100
    assert table([str(tmp_path / "s"), "--rows", "rounds", "--cols", "algorithm", "--format", "csv",
                  "--out", str(tmp_path / "t.csv")]) == 0
    rows = (tmp_path / "t.csv").read_text().strip().splitlines()
    assert len(rows) == 3
    for line in rows[1:]:
        rounds, cell = line.split(",")
        s = json.loads((tmp_path / "s" / f"rounds={rounds}" / "summary.json").read_text())
        assert cell == f"{100 * s['final_accuracy']:.1f} +- 0.0"


def test_a_sweep_with_a_bad_key_fails_before_any_point_runs(tmp_path, capfd):
    from raysim.sweep import main as sweep

    assert sweep([*SWEEP, "fedprox.muu=1", "--output-dir", str(tmp_path), "--name", "bad"]) == 2
    err = capfd.readouterr().err
    assert "unknown config key 'fedprox.muu'" in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()
    assert sweep(["seed=0,1", "algorithm=fedavg,fedfoo", "--output-dir", str(tmp_path), "--name", "bad"]) == 2
    assert "algorithm='fedfoo' is not a known algorithm" in capfd.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_sweep_whose_worker_process_is_killed_fails_its_points_and_the_rerun_resumes_them(tmp_path):
    """--processes 2 (sweep_pool.py) with a worker killed mid-point, as the OOM killer would:
    the sweep ends (exit 2), naming each point it lost and how to retry; the rerun resumes both
    from their checkpoints and finishes them."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    args = [sys.executable, "-m", "raysim.sweep", "seed=0,1", "rounds=200", "model=mclr", "num_clients=6",
            "checkpoint_every=5", "--processes", "2", "--output-dir", str(tmp_path), "--name", "k"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    points = [tmp_path / "k" / f"seed={s}" for s in (0, 1)]
    deadline = time.time() + 240
    while not all((d / "checkpoint.pt").exists() for d in points) and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    workers = [c for c in psutil.Process(p.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(workers) == 2 and all((d / "checkpoint.pt").exists() for d in points), p.communicate()
    workers[0].send_signal(signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err[-2000:]
    assert out.count("failed: BrokenProcessPool") == 2 and "point seed=0 failed" in out, out[-2000:]
    assert "of 2 points failed (above); rerun the sweep to retry them" in err
    assert not any((d / "summary.json").exists() for d in points)
    r = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 points, 0 done, 2 to run" in r.stdout
    for d in points:
        assert "checkpoint of round" in (d / "log.txt").read_text()  # resumed, not started again
        assert json.loads((d / "summary.json").read_text())["rounds"] == 200


def test_points_run_in_processes_must_not_ask_for_ray_and_a_bad_count_is_named(tmp_path, capfd):
    """--processes N trains each point's clients in its own process (sweep_pool.py): a point
    that asks for client actors is refused before anything runs, as is a count that is not
    one, from the command line or the sweep file; each in one line naming where it came from."""
    from raysim.sweep import main as sweep

    out = ["--output-dir", str(tmp_path), "--name", "p"]
    assert sweep([*SWEEP, "resources.num_actors=1", "--processes", "2", *out]) == 2
    err = capfd.readouterr().err
    assert "processes 2 (--processes, or the sweep file's processes:) runs each point's clients in the point's " \
           "own process, with no Ray; point seed=0 asks for Ray (resources.num_actors / clients_per_actor ask for client actors)" in err and err.count("\n") == 1
    assert sweep([*SWEEP, "--processes", "two", *out]) == 2
    assert capfd.readouterr().err == "error: --processes: 'two' is not a number of processes (an integer >= 1, or auto)\n"
    f = tmp_path / "s.yaml"
    f.write_text("grid: {seed: [0, 1]}\nprocesses: 0\n")
    assert sweep(["--file", str(f), *out]) == 2
    assert capfd.readouterr().err == (f"error: sweep file {f}: processes: 0 is not a number of processes (an integer "
                                      ">= 1, or auto)\n")
    assert not (tmp_path / "p").exists()


def test_sweep_values_split_on_top_level_commas_and_a_file_says_the_same(tmp_path):
    from raysim.sweep import parse, split_values

    assert split_values("0,1,[2,3]") == ["0", "1", "[2,3]"]
    f = tmp_path / "s.yaml"
    f.write_text("name: x\nfixed: {rounds: 2}\ngrid: {seed: [0, 1], model_options.hidden: [[4], [8, 8]]}\n")
    name, files, fixed, grid = parse([], f)
    assert name == "x" and fixed == ["rounds=2"] and grid == {"seed": ["0", "1"], "model_options.hidden": ["[4]", "[8, 8]"]}
    assert parse(["seed=0,1", "rounds=3"], None)[2:] == (["rounds=3"], {"seed": ["0", "1"]})


def wandb_history(run_file) -> list[dict]:
    """The history rows of an offline W&B run file: LevelDB's log format (32 KiB blocks of
    records with a 7-byte header: CRC, length, type full / first / middle / last) after W&B's
    7-byte file header, each record a `wandb_internal_pb2.Record`."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks, part = run_file.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            part = (b"" if kind == 2 else part) + chunk
        elif kind == 4:
            chunks.append(part + chunk)
    rows = []
    for c in chunks:
        record = pb.Record()
        record.ParseFromString(c)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_an_mlflow_file_store_holds_every_round(tmp_path):
    """log.mlflow_uri=file:...: MLflow's file store (in maintenance in MLflow 3, so raysim opts
    in for a user who names one) gets the config, each round and the summary."""
    import mlflow

    from raysim.runtime.trackers import Trackers

    uri = (tmp_path / "mlruns").as_uri()
    cfg = {"output_dir": str(tmp_path), "model": "mclr",
           "log": {"mlflow": True, "mlflow_uri": uri, "mlflow_experiment": "raysim", "group": None}}
    (tmp_path / "r").mkdir()
    trackers = Trackers(tmp_path / "r", cfg)
    for rnd, acc in ((1, 0.5), (2, 0.75)):
        trackers.round({"round": rnd, "accuracy": acc, "selected": [1, 2], "flag": True})
    trackers.finish({"final_accuracy": 0.75})
    run_id = json.loads((tmp_path / "r" / "trackers.json").read_text())["mlflow"]
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "accuracy")] == [(1, 0.5), (2, 0.75)]
    run = client.get_run(run_id)
    assert run.data.params["model"] == "mclr" and run.data.metrics["summary.final_accuracy"] == 0.75
    assert "selected" not in run.data.metrics and "flag" not in run.data.metrics  # numbers only


def test_trackers_hold_every_rounds_metrics(ray_local, tmp_path):
    """One run with TensorBoard, W&B (offline) and MLflow (its local database), stopped after
    round 2 and resumed: each holds every round's accuracy once, as the metrics table has it,
    in one tracker run, with the config and the final summary; off by default; a sweep's
    points are grouped under its name."""
    import json

    import mlflow
    import pyarrow.parquet as pq
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["model=mclr", "rounds=2", "num_clients=6", "log.tensorboard=true", "log.wandb=true",
                 "log.wandb_mode=offline", "log.mlflow=true", "checkpoint_every=1", f"output_dir={tmp_path}",
                 "run_name=tb", "--quiet"]) == 0
    assert main([f"resume={tmp_path / 'tb'}", "rounds=3", "--quiet"]) == 0  # the same tracker runs go on
    rows = pq.read_table(tmp_path / "tb" / "metrics.parquet").to_pylist()
    want = [(r["round"], r["accuracy"]) for r in rows]
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value, abs=1e-6)) for e in events.Scalars("accuracy")] == want
    assert "train_loss" in events.Tags()["scalars"]
    ids = json.loads((tmp_path / "tb" / "trackers.json").read_text())
    run_files = sorted((tmp_path / "tb" / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    assert len(run_files) == 2  # W&B keeps a resumed offline run's part in a folder of its own, with the run's id
    history = [h for f in run_files for h in wandb_history(f)]
    assert [(h["_step"], h["accuracy"]) for h in history] == want
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "accuracy")] == want
    run = client.get_run(ids["mlflow"])
    assert run.data.params["model"] == "mclr" and run.info.status == "FINISHED"
    assert run.data.metrics["summary.final_accuracy"] == rows[-1]["accuracy"]
    assert main(["model=mclr", "rounds=1", "num_clients=6", f"output_dir={tmp_path}", "run_name=off", "--quiet"]) == 0
    assert not {"tensorboard", "wandb", "trackers.json"} & {p.name for p in (tmp_path / "off").iterdir()}
    from raysim.sweep import parse, plan

    _, files, fixed, grid = parse(["seed=0,1", "rounds=1"], None)
    assert all("log.group=grp" in p["overrides"] for p in plan(files, fixed, grid, tmp_path / "grp"))


def test_every_shipped_sweep_file_plans_points_that_pass_the_checks(tmp_path):
    from pathlib import Path

    import itertools

    from raysim.sweep import parse, plan, read_skip, skipped

    files = sorted((Path(__file__).resolve().parent.parent / "configs" / "sweeps").glob("*.yaml"))
    assert files
    for f in files:
        name, configs, fixed, grid = parse([], f)
        if "seed" in grid:  # a seed never changes what the checks see: one seed's points (a third of the time)
            grid["seed"] = grid["seed"][:1]
        skip = read_skip(f, grid)
        points = plan(configs, fixed, grid, tmp_path / name, skip)
        ran = [c for c in itertools.product(*grid.values()) if not skipped(dict(zip(grid, c)), skip)]
        assert len(points) == len(ran) and len({p["name"] for p in points}) == len(points)


def test_table_metrics_from_the_per_round_curve(four_runs):
    import statistics

    from raysim.results.runs import find_runs

    for run in find_runs([four_runs]):
        acc = [r["accuracy"] for r in run.rows]
        assert run.value("accuracy@2") == acc[1]
        assert run.value("max(accuracy)") == max(acc) and run.value("mean(accuracy)") == statistics.mean(acc)
        assert run.value("last10(accuracy)") == statistics.mean(acc[-10:])
        first = next(i + 1 for i, a in enumerate(acc) if a >= acc[1])
        assert run.value(f"round(accuracy>={acc[1]})") == first
        assert run.value("round(accuracy>=1.01)") is None


def test_equal_communication_and_several_metrics_in_one_table(four_runs, capsys):
    """NAME@XMiB reads a curve at the last round within X MiB of traffic (down + up, the
    runtime's count), lastK(NAME@XMiB) its last K values there; several --metric options give
    one column each."""
    import statistics

    from raysim.results.runs import find_runs
    from raysim.results.table import main as table

    run = find_runs([four_runs / "fedavg-0"])[0]
    mib = [(r["bytes_down"] + r["bytes_up"]) / 2**20 for r in run.rows]
    acc = [r["accuracy"] for r in run.rows]
    budget = (mib[1] + mib[2]) / 2  # between rounds 2 and 3
    assert run.value(f"accuracy@{budget}MiB") == acc[1]
    assert run.value(f"last2(accuracy@{budget}MiB)") == statistics.mean(acc[:2])
    assert run.value("max(mib)") == mib[-1] and run.value("accuracy@9") is None  # the run has 3 rounds
    assert table([str(four_runs), "--rows", "dataset", "--metric", "last2(accuracy)", "--metric", "max(mib)",
                  "--format", "csv"]) == 0
    head, row = capsys.readouterr().out.strip().splitlines()
    assert head == "dataset,\"fedavg, last2(accuracy)\",\"fedavg, max(mib)\",\"fedprox, last2(accuracy)\",\"fedprox, max(mib)\""
    assert row.split(",")[2] == f"{mib[-1]:.4g} +- 0"  # same traffic for every seed
    assert table([str(four_runs), "--metric", "last10(accuracy>=0.5)"]) == 2
    assert table([str(four_runs), "--metric", "mean(accuracy"]) == 2
    assert "is not understood" in capsys.readouterr().err


def test_two_grid_points_with_one_folder_name_are_refused(tmp_path):
    from raysim.errors import ConfigError
    from raysim.sweep import plan

    same = ["algorithm=fedavg", "model=mclr"]
    with pytest.raises(ConfigError, match="share the folder name"):
        plan([], [], {"variant": [same, list(same)]}, tmp_path)


def test_a_command_line_value_cuts_an_axis_of_the_sweep_file(tmp_path):
    from pathlib import Path

    from raysim.sweep import parse, plan

    f = Path(__file__).resolve().parent.parent / "configs" / "sweeps" / "selection_digits.yaml"
    name, configs, fixed, grid = parse(["seed=0", "rounds=5"], f)
    assert grid["seed"] == ["0"] and "rounds=5" in fixed
    points = plan(configs, fixed, grid, tmp_path / name)
    assert len(points) == 3 and all(p["name"].startswith("seed=0,") for p in points)


def test_a_table_row_shows_only_the_sections_its_run_reads(four_runs, capsys):
    """FedAvg's config carries fedprox.* defaults it never reads: its row says '-' there, and
    the key does not count as differing between FedAvg and FedProx."""
    from raysim.results.runs import differing_keys, find_runs
    from raysim.results.table import main as table

    runs = find_runs([four_runs])
    assert "fedprox.mu" not in differing_keys(runs)
    assert table([str(four_runs), "--rows", "algorithm,fedprox.mu", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("\"fedavg, -\",") and lines[2].startswith("\"fedprox, 0.01\",")


def test_a_table_of_rows_with_other_keys_has_every_key_in_first_seen_order_and_nulls_where_absent():
    """The run directory's tables (runtime/writer.py `_table`, built by column): rows that differ in
    keys (a round with a joiner's row, a compressed update's bytes) give one column per key, in the
    order the keys are first met, None where a row lacks one; rows that all share theirs likewise."""
    import pyarrow as pa

    from raysim.runtime.writer import _table

    rows = [{"cid": 1, "status": "ok", "loss": 0.5}, {"cid": 2, "status": "dropped", "reason": "dropout"},
            {"cid": 3, "status": "ok", "loss": 0.25}, {"bytes_up": 10, "cid": 4}]
    t = _table(rows)
    assert t.column_names == ["cid", "status", "loss", "reason", "bytes_up"]
    assert t.to_pylist() == [{k: r.get(k) for k in t.column_names} for r in rows]
    assert t.schema.field("loss").type == pa.float64() and t.schema.field("cid").type == pa.int64()
    same = _table(rows[:1] + [{"cid": 5, "status": "ok", "loss": None}])
    assert same.column_names == ["cid", "status", "loss"] and same.column("loss").to_pylist() == [0.5, None]
