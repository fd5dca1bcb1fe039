"""The published results table (issue 56): a sweep over labelled settings x algorithms x
seeds, with combinations that cannot run skipped, resumes without re-running what is done;
`python -m raysim.results.table --sweep ... --doc ...` writes the document, each row's config
and every run's model hash, and running a row's config gives the hashed bits again."""
import csv
import json
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from raysim.results.table import main as table
from raysim.run import main as run

SWEEP = """name: t
fixed: {rounds: 2, num_clients: 6, participation: 0.5, system: {profile: uniform}, partition: {test_fraction: 0.2}}
grid:
  seed: [0]
  setting:
    - {label: digits, dataset: digits, model: mlp, model_options: {hidden: [16]}}
    - {label: syn, dataset: synthetic, model: mclr, num_clients: 5}
  algorithm: [fedavg, fedper]
skip:
  - {setting: syn, algorithm: fedper}   # mclr's encoder has no weights to share
"""


def sweep(args: list) -> tuple[int, str, str]:
    """`python -m raysim.sweep ARGS` in its own process (its own local Ray, as a user's)."""
    p = subprocess.run([sys.executable, "-m", "raysim.sweep", *args], capture_output=True, text=True, timeout=900)
    return p.returncode, p.stdout, p.stderr


def test_the_published_table_runs_its_sweep_once_and_documents_every_cell(tmp_path):
    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    runs = tmp_path / "runs"
    rc, out, err = sweep(["--file", str(f), "--output-dir", str(runs)])
    assert rc == 0, err
    assert sorted(p.name for p in (runs / "t").iterdir() if not p.name.startswith(".")) == [
        "seed=0,setting=digits,algorithm=fedavg", "seed=0,setting=digits,algorithm=fedper",
        "seed=0,setting=syn,algorithm=fedavg"]
    rc, out, _ = sweep(["--file", str(f), "--output-dir", str(runs)])  # nothing to run again
    assert rc == 0 and "3 points, 3 done, 0 to run" in out

    doc = tmp_path / "docs" / "results.md"
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "notes.yaml").write_text(
        '"digits/fedper": "FedPer trails here because X."\n"*/fedavg": "FedAvg everywhere: Y."\n')
    assert table(["--sweep", str(f), "--doc", str(doc), "--runs-dir", str(runs)]) == 0
    text = doc.read_text()
    # notes: numbered in the order the tables cite them, one number per text, listed under the tables
    fedavg_rows = [line for line in text.splitlines() if line.startswith("| [fedavg]")]
    assert len(fedavg_rows) == 2 and all(r.endswith("[note 1](#note-1) |") for r in fedavg_rows)
    assert '<a id="note-2"></a>**Note 2.** FedPer trails here because X.' in text
    assert "[note 2](#note-2)" in next(line for line in text.splitlines() if line.startswith("| [fedper]"))
    assert "## digits" in text and "## syn" in text and "3 of 3 runs done" in text
    fedavg = json.loads((runs / "t" / "seed=0,setting=digits,algorithm=fedavg" / "summary.json").read_text())
    curve = pq.read_table(runs / "t" / "seed=0,setting=digits,algorithm=fedavg" / "metrics.parquet").to_pydict()
    glob = [a for a in curve["accuracy"] if a is not None]
    own = [a for a in curve["local_accuracy"] if a is not None]
    last3 = lambda v: 100 * sum(v[-3:]) / len(v[-3:])  # noqa: E731  # a run's accuracy: its last 3 evaluations
    assert (f"| [fedavg](results/digits/fedavg.yaml) | - | {last3(glob):.1f} ± 0.0 | {100 * max(glob):.1f} ± 0.0 | "
            f"{last3(own):.1f} ± 0.0 | {100 * max(own):.1f} ± 0.0 |") in text  # per client: the global model there
    assert f"Every run from raysim {fedavg['raysim_commit']} (3 runs)" in text
    fedper_row = next(line for line in text.splitlines() if line.startswith("| [fedper](results/digits/"))
    assert "†" in fedper_row and fedper_row.split("|")[5].strip() != "-"  # its own models' accuracy
    assert "| fedper | not run |" in text and "on syn: fedper." in text
    hashes = list(csv.DictReader((tmp_path / "docs" / "results" / "runs.csv").open()))
    assert len(hashes) == 3 and all(len(h["model_sha256"]) == 64 for h in hashes)
    assert all(h["client_processors"] and "torch" in h["client_processors"] for h in hashes)
    # each run's curve, every evaluation: its last point is the run's final accuracy
    assert all(h["accuracy_curve"].split()[-1] == f"2:{float(h['final_accuracy']):.4f}" for h in hashes)
    assert "Runs made on: " + hashes[0]["client_processors"] + " (3 runs, " in text

    # another machine: the run folders gone, the table is the same from runs.csv, and the
    # sweep leaves the listed points alone, running only one whose row is missing
    same = lambda a, b: re.sub(r"[\d.]+ h of run time", "", a) == re.sub(r"[\d.]+ h of run time", "", b)  # noqa: E731
    runs.rename(tmp_path / "gone")
    assert table(["--sweep", str(f), "--doc", str(doc), "--runs-dir", str(runs)]) == 0
    assert doc.read_text() == text
    listed = tmp_path / "docs" / "results" / "runs.csv"
    lines = listed.read_text().splitlines()
    listed.write_text("\n".join(line for line in lines if ",fedper," not in line) + "\n")
    rc, out, err = sweep(["--file", str(f), "--output-dir", str(runs), "--skip-listed", str(listed)])
    assert rc == 0, err
    assert "2 row(s), 2 of the grid's points listed: left out" in out and "1 points, 0 done, 1 to run" in out
    assert [p.name for p in (runs / "t").iterdir() if not p.name.startswith(".")] == [
        "seed=0,setting=digits,algorithm=fedper"]
    assert table(["--sweep", str(f), "--doc", str(doc), "--runs-dir", str(runs)]) == 0
    assert same(doc.read_text(), text)  # the rerun fedper: the same bits, so the same table (its run time aside)
    again = list(csv.DictReader(listed.open()))
    assert len(again) == 3
    # fedper ran second in the first sweep, in the processes the first point left (one point at
    # a time reuses them), and alone now, in fresh ones: the same model
    assert {h["algorithm"]: h["model_sha256"] for h in again if h["setting"] == "digits"} == \
        {h["algorithm"]: h["model_sha256"] for h in hashes if h["setting"] == "digits"}

    # --verify: rows re-run from their linked configs give the recorded bits; a row whose hash
    # was changed does not, and says so
    rc = table(["--sweep", str(f), "--doc", str(doc), "--verify", "2", "--draw", "1"])
    assert rc == 0
    tampered = listed.read_text().replace(want_hash := again[0]["model_sha256"], "0" * 64)
    listed.write_text(tampered)
    assert table(["--sweep", str(f), "--doc", str(doc), "--verify", "3"]) == 1
    listed.write_text(tampered.replace("0" * 64, want_hash))

    # one cell again from its linked config: the same bits
    cell = tmp_path / "docs" / "results" / "digits" / "fedavg.yaml"
    assert "output_dir" not in cell.read_text() and "seed" not in cell.read_text().split("\n")[0]
    assert run(["--config", str(cell), "seed=0", f"output_dir={tmp_path / 'again'}", "run_name=r", "--quiet"]) == 0
    again = json.loads((tmp_path / "again" / "r" / "summary.json").read_text())
    want = next(h for h in hashes if h["setting"] == "digits" and h["algorithm"] == "fedavg")
    assert again["model_sha256"] == want["model_sha256"] == fedavg["model_sha256"]


def test_a_cell_with_a_diverged_run_says_so(tmp_path):
    """From runs.csv alone (no run folders): a run that stopped on a non-finite model counts
    with its last evaluation, and its cell says how many did."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    (tmp_path / "results").mkdir()
    rows = [{"setting": "digits", "algorithm": "fedavg", "seed": "0", "final_accuracy": "0.5",
             "final_local_accuracy": "0.4", "status": "diverged", "model_sha256": ""},
            {"setting": "digits", "algorithm": "fedper", "seed": "0", "final_accuracy": "0.9",
             "final_local_accuracy": "0.8", "final_personal_accuracy": "0.95", "server_model_unshared": "head",
             "status": "finished", "model_sha256": "ab" * 32}]
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    assert write_doc(f, tmp_path / "results.md", tmp_path / "runs") == {"runs": 3, "done": 2}
    text = (tmp_path / "results.md").read_text()
    assert "| fedavg | - | 1 diverged | - | 1 diverged | - |" in text  # never its numbers from before it diverged
    assert "| fedper | - | 90.0 ± 0.0 † | 90.0 ± 0.0 | 95.0 ± 0.0 | 95.0 ± 0.0 |" in text  # per client: its own models'


def test_a_setting_that_runs_fewer_seeds_counts_its_cells_by_its_own_seeds(tmp_path):
    """Seeds 0-2 for digits, 0-1 for syn (the sweep file's `only`, issue 84: the cheap settings
    run more seeds): syn's cell with both its seeds is whole; digits' with two of three says so."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP.replace("seed: [0]", "seed: [0, 1, 2]")
                 + "only:\n  - {seed: 2, setting: [digits]}\n")
    (tmp_path / "results").mkdir()
    rows = [{"setting": s, "algorithm": "fedavg", "seed": str(seed), "final_accuracy": str(acc),
             "final_local_accuracy": str(acc), "status": "finished", "model_sha256": "ab" * 32}
            for s, seed, acc in (("digits", 0, 0.5), ("digits", 1, 0.7), ("syn", 0, 0.6), ("syn", 1, 0.8))]
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    assert write_doc(f, tmp_path / "results.md", tmp_path / "runs") == {"runs": 8, "done": 4}  # digits: fedavg and fedper x 3, syn: fedavg x 2
    text = (tmp_path / "results.md").read_text()
    digits, syn = text.split("## syn")[0], text.split("## syn")[1]
    assert "| fedavg | - | 60.0 ± 14.1 (2/3) |" in digits
    assert "| fedavg | - | 70.0 ± 14.1 |" in syn
    assert "Seeds per setting (the sweep file's `only`): digits 0, 1, 2; syn 0, 1." in text
    assert "on syn: fedper." in text  # not run: the cell the sweep file skips, not syn's fedavg on seed 2


def test_skip_listed_that_names_no_grid_axis_or_no_file_is_one_line(tmp_path):
    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    rc, _, err = sweep(["--file", str(f), "--skip-listed", str(tmp_path / "none.csv")])
    assert rc == 2 and err.strip() == f"error: --skip-listed {tmp_path / 'none.csv'}: no such file"
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    rc, _, err = sweep(["--file", str(f), "--skip-listed", str(tmp_path / "x.csv")])
    assert rc == 2 and "no column names a grid axis (seed, setting, algorithm); its columns: a, b" in err
    assert len(err.strip().splitlines()) == 1


def test_one_cell_with_an_option_of_its_algorithms_own_section(tmp_path):
    """`setting=digits algorithm=fedprox fedprox.mu=0.5`: the fixed keys set a section only the
    picked algorithm reads; Ray's settings come from a point's config, not from the fixed keys
    alone (which, read with the default algorithm, refused `fedprox.*`)."""
    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    rc, out, err = sweep(["--file", str(f), "--output-dir", str(tmp_path / "runs"), "setting=digits",
                          "algorithm=fedprox", "fedprox.mu=0.5", "rounds=1"])
    assert rc == 0, err
    saved = (tmp_path / "runs" / "t" / "seed=0,setting=digits,algorithm=fedprox" / "config.yaml").read_text()
    assert "mu: 0.5" in saved


def test_a_clustered_methods_global_model_is_marked_and_its_clients_judged_by_their_group_models():
    from raysim.results.published import _accuracy, _global_mark, _method

    assert _global_mark("ifca", [{"record": {}}]) == " ‡" and _global_mark("fedgroup", [{"record": {}}]) == " ‡"
    assert _global_mark("fedavg", [{"record": {}}]) == ""
    assert _global_mark("fedper", [{"record": {"server_model_unshared": "head"}}]) == " †"
    assert _accuracy({"final_local_accuracy": 0.5}, True, 3) == 0.5
    assert _accuracy({"final_local_accuracy": 0.5, "final_personal_accuracy": 0.9}, True, 3) == 0.9
    assert _accuracy({"per_client_curve": "5:0.5000 10:0.7000 15:0.6000 20:0.8000"}, True, 3) == pytest.approx(0.7)
    assert _accuracy({"per_client_curve": "5:0.5000 10:0.7000 15:0.6000 20:0.8000"}, True, 0) == 0.8
    assert _method("fedavg") == "fedavg" and _method(["#label=fjord", 'algorithm="heterofl"']) == "heterofl"


def test_a_note_for_no_cell_is_one_line_naming_the_file(tmp_path):
    import pytest

    from raysim.errors import ConfigError
    from raysim.results.published import write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.yaml").write_text('"digits/fedavgg": "typo"\n')
    with pytest.raises(ConfigError, match=r"notes.yaml: 'digits/fedavgg' names no cell"):
        write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert not (tmp_path / "results.md").exists()


def test_a_labelled_setting_is_picked_on_the_command_line_and_a_wrong_one_is_one_line(tmp_path):
    from raysim.sweep import parse, plan, read_skip

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    _, files, fixed, grid = parse(["setting=syn", "algorithm=fedavg,fedper"], f)
    points = plan(files, fixed, grid, tmp_path / "t", read_skip(f, grid))
    assert [p["name"] for p in points] == ["seed=0,setting=syn,algorithm=fedavg"]  # fedper on syn: skipped
    assert 'dataset="synthetic"' in points[0]["overrides"]


def test_a_key_on_the_command_line_wins_over_the_picked_variants_own(tmp_path):
    """`setting=syn model=mlp num_clients=8`: the variant sets model and num_clients itself; the
    command line's values are what the point runs (they were silently dropped before)."""
    from raysim.config import read_layers, resolve
    from raysim.sweep import parse, plan, read_skip

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    _, files, fixed, grid = parse(["setting=syn", "algorithm=fedavg", "model=mlp", "num_clients=8",
                                   "model_options.hidden=[8]"], f)
    (point,) = plan(files, fixed, grid, tmp_path / "t", read_skip(f, grid))
    cfg = resolve(read_layers(files, point["overrides"]))
    assert (cfg.dataset, cfg.model, cfg.num_clients, list(cfg.model_options.hidden)) == ("synthetic", "mlp", 8, [8])
    assert cfg.participation == 0.5  # the sweep file's fixed value: the command line did not set it


def test_the_wrong_label_and_skip_are_one_line_each(tmp_path, capfd):
    from raysim.sweep import main as sweep_here

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    assert sweep_here(["--file", str(f), "--output-dir", str(tmp_path), "setting=mnist"]) == 2
    err = capfd.readouterr().err
    assert "setting=mnist: not a label of grid.setting; its labels: digits, syn" in err and err.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(SWEEP.replace("{setting: syn, algorithm: fedper}", "{setting: cifar, algorithm: fedper}"))
    assert sweep_here(["--file", str(bad), "--output-dir", str(tmp_path)]) == 2
    assert "skip's setting=cifar is none of grid.setting's values or labels" in capfd.readouterr().err
    assert not (tmp_path / "t").exists()


def test_a_sweep_after_a_run_in_the_same_ray_session_gets_the_cpus(ray_local, tmp_path):
    """A run in this process keeps its server and client actors for the next run
    (`ray.reuse_workers`), holding the session's CPUs; a sweep started next in the same
    session (a notebook) releases them, so its points' actors are placed (they waited out
    `resources.placement_timeout` before)."""
    from raysim.sweep import main as sweep_here

    common = ["dataset=digits", "model=mlp", "num_clients=6", "rounds=1", "resources.num_actors=4"]
    assert run([*common, "resources.ray_start_s=0", f"output_dir={tmp_path}", "run_name=first", "--quiet"]) == 0
    assert ray_local.available_resources().get("CPU", 0) < 1  # the kept actors hold them
    assert sweep_here([*common, "seed=0,1", "resources.placement_timeout=60", "--output-dir", str(tmp_path),
                       "--name", "after"]) == 0
    assert all((tmp_path / "after" / f"seed={s}" / "summary.json").is_file() for s in (0, 1))


def test_points_two_at_a_time_run_in_finished_points_processes_and_give_fresh_runs_models(ray_local, tmp_path):
    """Four points of 1 actor of 2 CPUs on the session's 4: two at a time, the later two in
    the processes the first two kept (Tune's `reuse_actors`, runtime/pool.py); a reused
    point's model is the one a fresh run makes (whose server has every CPU's torch threads:
    the same bits)."""
    from raysim.sweep import main as sweep_here

    common = ["dataset=digits", "model=mlp", "num_clients=6", "rounds=2", "resources.num_actors=1",
              "resources.num_cpus_per_actor=2"]
    assert sweep_here([*common, "seed=0,1,2,3", "--output-dir", str(tmp_path), "--name", "two"]) == 0
    logs = [(tmp_path / "two" / f"seed={s}" / "log.txt").read_text() for s in range(4)]
    # each point's server: the 2 CPUs a point gets less its actor's 2, at least 1 torch thread
    assert all("server_threads: 1" in (tmp_path / "two" / f"seed={s}" / "config.yaml").read_text() for s in range(4))
    reused = [s for s in range(4) if "reused from an earlier run" in logs[s]]
    assert reused, "no point ran in processes a finished point kept"
    seed = reused[-1]
    assert run([*common, f"seed={seed}", "ray.reuse_workers=false", f"output_dir={tmp_path}", "run_name=fresh",
                "--quiet"]) == 0
    sha = [json.loads((d / "summary.json").read_text())["model_sha256"]
           for d in (tmp_path / "two" / f"seed={seed}", tmp_path / "fresh")]
    assert sha[0] == sha[1]


def test_a_table_of_runs_from_two_commits_is_refused_unless_allowed_and_then_says_so(tmp_path):
    from raysim.errors import ConfigError
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    (tmp_path / "results").mkdir()
    rows = [{"setting": "digits", "algorithm": a, "seed": "0", "final_accuracy": "0.5", "status": "finished",
             "model_sha256": "ab" * 32, "raysim_commit": c, "accuracy_curve": "5:0.4000 10:0.5000"}
            for a, c in (("fedavg", "aaa"), ("fedper", "bbb"))]
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    (tmp_path / "runs" / "t").mkdir(parents=True)  # the sweep's tuning choices, copied beside runs.csv
    (tmp_path / "runs" / "t" / "tuning.csv").write_text(
        "setting,algorithm,point,score,chosen\ndigits,fedavg,lr=0.1,0.5,1\n")
    with pytest.raises(ConfigError, match="the runs come from 2 versions of raysim: aaa .1 runs.; bbb .1 runs."):
        write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert not (tmp_path / "results" / "tuning.csv").exists() and not (tmp_path / "results.md").exists()  # nothing
    write_doc(f, tmp_path / "results.md", tmp_path / "runs", allow_mixed=True)
    assert (tmp_path / "results" / "tuning.csv").is_file()
    assert "**Runs of 2 versions of raysim** (--allow-mixed): aaa (1 runs); bbb (1 runs)." in \
        (tmp_path / "results.md").read_text()


def test_each_cell_is_read_against_its_papers_claim_and_a_bad_claim_is_one_line(tmp_path):
    from raysim.errors import ConfigError
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP.replace("seed: [0]", "seed: [0, 1, 2]"))
    (tmp_path / "results").mkdir()
    # per client: FedPer 29-31 points above FedAvg, seed by seed (a paired test: p = 0.0004)
    owns = {"fedavg": (0.50, 0.55, 0.60), "fedper": (0.79, 0.85, 0.91)}
    rows = [{"setting": "digits", "algorithm": a, "seed": str(seed), "status": "finished",
             "model_sha256": f"{seed}{a}".ljust(64, "0"), "accuracy_curve": f"1:0.1000 2:{0.4 if a == 'fedavg' else 0.2}",
             "per_client_curve": f"1:0.1000 2:{own:.4f}"}
            for a, values in owns.items() for seed, own in enumerate(values)]
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    claims = tmp_path / "results" / "claims.yaml"
    claims.write_text("fedper: {baseline: fedavg, judge: own, claim: 'FedPer above FedAvg per client (Table 1)'}\n"
                      "fedavg: {baseline: fedper, judge: global, settings: [syn], claim: 'a claim about syn'}\n")
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    text = (tmp_path / "results.md").read_text()
    fedper = next(line for line in text.splitlines() if line.startswith("| fedper |"))
    assert "[yes](#claim-fedper)" in fedper  # 85.0 per client against FedAvg's 55.0
    assert "[n/c](#claim-fedavg)" in next(line for line in text.splitlines() if line.startswith("| fedavg |"))
    assert ("in 1 cells the table reproduces its paper's direction, in **0 it does not**, in 0 its seeds cannot tell "
            "(undecided: a paired t-test over the seeds, two-sided at 0.05, does not reject equal means), 1 are not "
            "comparable") in text
    assert '<a id="claim-fedper"></a>**fedper** (against fedavg, own): FedPer above FedAvg per client (Table 1)' in text
    assert "**fedavg** (against fedper, global; read on syn): a claim about syn" in text
    claims.write_text("fedper: {baseline: fedavg, judge: own, claim: x}\n"
                      "fedavg: {baseline: fedper, judge: own, claim: 'per client'}\n")
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert "[no](#claim-fedavg)" in next(line for line in (tmp_path / "results.md").read_text().splitlines()
                                          if line.startswith("| fedavg |"))  # 55.0 per client against FedPer's 85.0
    assert '**1 "no" cell(s) without a note yet**: digits/fedavg.' in (tmp_path / "results.md").read_text()
    (tmp_path / "results" / "notes.yaml").write_text('"digits/fedavg": "FedAvg has no personal model."\n')
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert "without a note yet" not in (tmp_path / "results.md").read_text()
    # a note that argues without a run says so in its cell (issue 84)
    (tmp_path / "results" / "notes.yaml").write_text('"digits/fedavg": "Read from the rows: cause not measured."\n')
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert next(line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| fedavg |")
                ).endswith("[note 1](#note-1) (cause not measured) |")
    (tmp_path / "results" / "notes.yaml").unlink()
    claims.write_text("fedavg: {baseline: fedper, judge: own, direction: below, claim: 'trails FedPer'}\n"
                      "fedper: {baseline: fedavg, judge: own, settings: [], claim: 'about feature shift'}\n")
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")  # a claim that the method trails; one of no setting here
    text = (tmp_path / "results.md").read_text()
    assert "[yes](#claim-fedavg)" in next(line for line in text.splitlines() if line.startswith("| fedavg |"))
    assert "[n/c](#claim-fedper)" in next(line for line in text.splitlines() if line.startswith("| fedper |"))
    assert "**fedavg** (below fedper, own): trails FedPer" in text
    assert "**fedper** (against fedavg, own; no setting of this table is its kind): about feature shift" in text
    claims.write_text("fedper: {baseline: fedavg, judge: own, direction: up, claim: x}\n")
    with pytest.raises(ConfigError, match="claims.yaml: fedper: direction must be above or below, not 'up'"):
        write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    claims.write_text("fedpr: {baseline: fedavg, judge: own, claim: x}\n")
    with pytest.raises(ConfigError, match="claims.yaml: fedpr: not an algorithm of the table"):
        write_doc(f, tmp_path / "results.md", tmp_path / "runs")


def _one_recorded_run(tmp_path, **more):
    """The SWEEP file, a runs.csv recording digits/fedavg's seed 0 (tuned lr=0.1) and an empty
    sweep folder: (the sweep file, the sweep folder)."""
    from raysim.results.published import RECORD

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    (tmp_path / "results").mkdir()
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerow({"setting": "digits", "algorithm": "fedavg", "seed": "0", "status": "finished", "tuned": "lr=0.1",
                    "model_sha256": "ab" * 32, "accuracy_curve": "1:0.4000 2:0.5000", **more})
    sweep_dir = tmp_path / "runs" / "t"
    sweep_dir.mkdir(parents=True)
    return f, sweep_dir


def test_the_tuned_column_and_the_sweeps_tuning_csv_kept_beside_runs_csv(tmp_path):
    from raysim.results.published import write_doc

    f, sweep_dir = _one_recorded_run(tmp_path)  # a recorded run keeps its own tuned point
    (sweep_dir / "tuning.csv").write_text("setting,algorithm,point,score,chosen\n"
                                          "digits,fedavg,lr=0.01,0.3,0\ndigits,fedavg,lr=0.1,0.6,1\n")
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert "| fedavg | lr=0.1 | 45.0 ± 0.0 |" in (tmp_path / "results.md").read_text()
    kept = (tmp_path / "results" / "tuning.csv").read_text()
    assert "digits,fedavg,lr=0.1,0.6,1" in kept
    assert "--tuned " + str(tmp_path / "results" / "tuning.csv") in (tmp_path / "results.md").read_text()


def test_a_model_made_after_the_last_round_is_the_cell_its_rounds_are_not(tmp_path):
    """CCVR calibrates its classifier after the last round (`after_training`): the run ends
    with that model, which no round's evaluation saw, so its cell is that model's accuracy
    (its best: the larger of it and the rounds' best); the rows before issue 72's column keep
    their curves' reading."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP)
    (tmp_path / "results").mkdir()
    rows = [{"setting": "digits", "algorithm": "fedavg", "seed": "0", "status": "finished", "model_sha256": "ab" * 32,
             "final_accuracy": "0.9000", "final_local_accuracy": "0.8000", "after_training": "1",
             "accuracy_curve": "1:0.4000 2:0.5000", "per_client_curve": "1:0.5000 2:0.6000"},
            {"setting": "digits", "algorithm": "fedper", "seed": "0", "status": "finished", "model_sha256": "cd" * 32,
             "final_accuracy": "0.9000", "accuracy_curve": "1:0.1000 2:0.2000", "per_client_curve": "1:0.8 2:0.9"}]
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    text = (tmp_path / "results.md").read_text()
    fedavg = next(line for line in text.splitlines() if line.startswith("| fedavg |")).split("|")
    assert [c.strip() for c in fedavg[3:7]] == ["90.0 ± 0.0", "90.0 ± 0.0", "80.0 ± 0.0", "80.0 ± 0.0"]
    fedper = next(line for line in text.splitlines() if line.startswith("| fedper |")).split("|")
    assert fedper[3].strip().startswith("15.0 ± 0.0")  # its curves' last evaluations, not final_accuracy


def test_a_claim_is_decided_by_a_paired_test_over_the_seeds(tmp_path):
    """Three seeds each, FedPer against FedAvg (55 / 65 / 60, sd 5) per client, worked by hand
    (t on the differences, 2 degrees of freedom, two-sided 0.05: |t| > 4.303):
    - differences 3, 3, 4 points: mean 3.33, sd 0.577, t = 10.0, p = 0.0099: yes, where the
      old rule (means apart by more than the larger sd) said tie: the seeds pair the runs;
    - differences 13, -1, 6: mean 6.0, sd 7.0, t = 1.48, p = 0.28: undecided at 3 seeds,
      where the old rule said yes (6 points apart, sds 5 and 2);
    - differences -5, -5, -6: no; one seed only: undecided at 1 seed; FedPer's seed 2
      diverged: the two seeds left decide (differences 5, 5: no spread, a yes)."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP.replace("seed: [0]", "seed: [0, 1, 2]"))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "claims.yaml").write_text("fedper: {baseline: fedavg, judge: own, claim: x}\n")
    fedavg = (0.55, 0.65, 0.60)
    cases = [((0.58, 0.68, 0.64), None, "yes"), ((0.68, 0.64, 0.66), None, "undecided at 3 seeds"),
             ((0.50, 0.60, 0.54), None, "no"), ((0.60,), None, "undecided at 1 seed"),
             ((0.60, 0.70, 0.10), 2, "yes")]
    for fedper, diverged, verdict in cases:
        rows = [{"setting": "digits", "algorithm": a, "seed": str(seed), "model_sha256": f"{seed}{a}".ljust(64, "0"),
                 "status": "diverged" if a == "fedper" and seed == diverged else "finished",
                 "accuracy_curve": "1:0.5000", "per_client_curve": f"1:{own:.4f}"}
                for a, owns in (("fedavg", fedavg), ("fedper", fedper)) for seed, own in enumerate(owns)]
        with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
            w = csv.DictWriter(out, RECORD)
            w.writeheader()
            w.writerows(rows)
        write_doc(f, tmp_path / "results.md", tmp_path / "runs")
        line = next(x for x in (tmp_path / "results.md").read_text().splitlines() if x.startswith("| fedper |"))
        assert f"[{verdict}](#claim-fedper)" in line, (fedper, line)


def test_the_paired_p_value_on_numbers_worked_by_hand():
    from raysim.results.stats import paired_p

    assert paired_p([58, 68, 64], [55, 65, 60]) == pytest.approx(0.0099, abs=1e-4)  # t = 10.0, df 2
    assert paired_p([68, 64, 66], [55, 65, 60]) == pytest.approx(0.276, abs=1e-3)  # t = 1.48
    assert paired_p([60, 70], [55, 65]) == 0.0 and paired_p([55, 65], [55, 65]) == 1.0  # no spread in the differences
    assert paired_p([60], [55]) is None


def test_the_header_states_the_regeneration_cost_of_tuning_and_table_runs(tmp_path):
    """The tuning runs' times travel in tuning.csv (wall_seconds); a row scored from a recorded
    tuning.csv keeps the time recorded with it; the header adds them to the table's runs'."""
    from raysim.results.published import write_doc
    from raysim.tuning import merge_tuned

    f, sweep_dir = _one_recorded_run(tmp_path, wall_seconds="1800")
    (sweep_dir / "tuning.csv").write_text("setting,algorithm,point,score,chosen,wall_seconds\n"
                                          "digits,fedavg,lr=0.01,0.3,0,3600\ndigits,fedavg,lr=0.1,0.6,1,5400\n")
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    doc = (tmp_path / "results.md").read_text()
    assert "the tuning's 2 runs took 2.5 h of run time, the table's runs 0.5 h: 3.0 h in all" in doc
    assert "Runs made on: not recorded (1 run, 0.5 h of run time)" in doc  # one run, not "1 runs"
    # the same cell scored again from a recorded file (no time of its own): the recorded times stay
    merge_tuned(tmp_path / "results" / "tuning.csv",
                [{"setting": "digits", "algorithm": "fedavg", "point": p, "score": s, "chosen": c}
                 for p, s, c in (("lr=0.01", 0.3, 0), ("lr=0.1", 0.6, 1))])
    kept = list(csv.DictReader((tmp_path / "results" / "tuning.csv").open()))
    assert [r["wall_seconds"] for r in kept] == ["3600", "5400"]


def test_many_algorithms_get_a_panel_each_with_the_baseline_in_grey(tmp_path):
    """Past 8 lines one axes repeats colours and dashes (FedAvg and the 41st row both solid blue):
    each algorithm its own panel, the first row's curve grey in the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from raysim.results import figures

    made = []
    real = plt.Figure.savefig

    def keep(fig, *a, **k):
        made.append(fig)
        return real(fig, *a, **k)

    lines = {f"alg{i}": [[(r, 10.0 * i / 2 + r) for r in (1, 2, 3)], [(r, 10.0 * i / 2 + r + 1) for r in (1, 2)]]
             for i in range(9)}
    plt.Figure.savefig = keep
    try:
        figures.band_curves(lines, tmp_path / "s.png", title="s", ylabel="accuracy (%)")
        figures.band_curves(dict(list(lines.items())[:3]), tmp_path / "few.png", title="s", ylabel="accuracy (%)")
    finally:
        plt.Figure.savefig = real
    panels = [ax for ax in made[0].axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == list(lines)
    assert len(panels[0].lines) == 1 and all(len(ax.lines) == 2 for ax in panels[1:])  # the baseline beside each
    grey = panels[4].lines[0]
    assert list(grey.get_ydata()) == [1.5, 2.5, 3.0]  # alg0's mean over the seeds that reached each round
    assert list(panels[4].lines[1].get_xdata()) == [1, 2, 3]  # a seed that stopped early: the line goes on with the other
    assert len(made[1].axes) == 1 and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_the_table_says_which_cells_the_sweep_file_sets_keys_for(tmp_path):
    """The sweep file's `cells:` entries (keys set for some cells only) are named above the
    claims, so a reader of those rows knows they did not run at the defaults."""
    from raysim.results.published import write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP + "cells:\n  - {setting: digits, algorithm: [fedper], set: {local: {lr: 0.05}}}\n")
    write_doc(f, tmp_path / "results.md", tmp_path / "runs")
    assert ("Set for some cells only (the sweep file's `cells`, each with its reason there): setting digits and "
            "algorithm fedper: local.lr = 0.05.") in (tmp_path / "results.md").read_text()


def test_verify_checks_the_config_hash_names_the_commit_and_reports_another_processor(tmp_path):
    """--verify (issue 84): six rows of one real run, each re-run from its linked config:
    as recorded (the same bits); made at another commit (said, and still the same bits);
    a config hash that is not the linked config's (a failure); another processor (its
    accuracy reported beside the row's, neither passed nor failed)."""
    from raysim.results.published import RECORD, _write_config
    from raysim.results.verify import verify

    assert run(["dataset=digits", "model=mlp", "model_options.hidden=[16]", "rounds=2", "num_clients=6",
                "participation=0.5", "seed=0", f"output_dir={tmp_path / 'made'}", "run_name=r", "--quiet"]) == 0
    summary = json.loads((tmp_path / "made" / "r" / "summary.json").read_text())
    side = tmp_path / "paper"
    row = {"setting": "digits", "seed": "0", "status": "finished", "final_accuracy": summary["final_accuracy"],
           "model_sha256": summary["model_sha256"], "raysim_commit": summary["raysim_commit"],
           "config_sha256": summary["config_sha256"], "client_processors": "; ".join(summary["client_processors"])}
    variants = {"a": {}, "b": {"raysim_commit": "f" * 40}, "c": {"config_sha256": "0" * 64},
                "d": {"client_processors": "Another CPU (AVX2), torch 1.0"},
                "e": {"client_processors": re.sub(r" \([A-Z0-9_]+\),", ",", row["client_processors"])},
                "f": {"config_sha256": "0" * 64, "raysim_commit": "f" * 40}}
    for name in variants:
        _write_config(tmp_path / "made" / "r", side / "digits" / f"{name}.yaml", {})
    with (side / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows({**row, "algorithm": name, **change} for name, change in variants.items())
    said = []
    got = {r["row"][1]: r for r in verify(tmp_path / "paper.md", 6, draw=5, say=said.append)}
    assert got["a"]["ok"] is True and got["a"]["what"] == "the same bits" and got["a"]["same_commit"]
    assert got["b"]["ok"] is True and got["b"]["what"].startswith("the same bits (re-run at HEAD ")
    assert got["b"]["what"].endswith("the row made at ffffffffffff)") and not got["b"]["same_commit"]
    assert got["c"]["ok"] is False and got["c"]["what"].startswith("DIFFERENT config: the linked config hashes to "
                                                                   f"{summary['config_sha256'][:12]}")
    assert got["d"]["ok"] is None and got["d"]["same_machine"] is False
    assert "not the row's Another CPU (AVX2), torch 1.0: final accuracy" in got["d"]["what"]
    assert "(+0.00 points; the cell's seeds' std 0.00 points over 1 runs)" in got["d"]["what"]
    # a row of before the instruction set was recorded: compared on the processor's name
    assert got["e"]["ok"] is True and "the row names no instruction set; here: " in got["e"]["what"]
    # another hash at another commit: an option added since changes it too, so not judged
    assert got["f"]["ok"] is None and got["f"]["what"].startswith("not judged: another config hash")
    assert len(said) == 12  # a line per row and one per result


def test_a_cost_claim_is_read_in_mib_sent_to_a_target_from_the_rows_mib_curve(tmp_path):
    """Issue 84 (LG-FedAvg: fewer bytes): `measure: mib_to_target` reads the MiB each run has
    sent when it first reaches the target share of the baseline's accuracy (runs.csv's
    mib_curve, recorded per evaluated round). Worked by hand: 90 % of FedAvg's final 0.90 is
    0.81; FedAvg reaches it at rounds 15, 15, 10, having sent 30, 30, 20 MiB; FedPer at round
    5 in every seed, having sent 60, 61, 52: differences 30, 31, 32 MiB, t = 53.7 with 2 df:
    more bytes, so "fewer bytes" is a no, where "fewer rounds" is a yes. A row without a
    mib_curve (made before it was recorded): no verdict."""
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP.replace("seed: [0]", "seed: [0, 1, 2]"))
    (tmp_path / "results").mkdir()
    glob = {"fedavg": ["5:0.5000 10:0.8000 15:0.9000", "5:0.5000 10:0.8000 15:0.9000", "5:0.5000 10:0.8200 15:0.9000"],
            "fedper": ["5:0.8500 10:0.5000 15:0.5000", "5:0.8600 10:0.5100 15:0.5000", "5:0.8700 10:0.5000 15:0.5200"]}
    mib = {"fedavg": ["5:10 10:20 15:30"] * 3, "fedper": ["5:60 10:120 15:180", "5:61 10:122 15:183", "5:52 10:104 15:156"]}

    def verdict(claim: str, with_mib: bool = True) -> str:
        rows = [{"setting": "digits", "algorithm": a, "seed": str(s), "status": "finished", "final_accuracy": "0.5",
                 "model_sha256": f"{s}{a}".ljust(64, "0"), "accuracy_curve": glob[a][s],
                 "mib_curve": mib[a][s] if with_mib else ""} for a in glob for s in range(3)]
        with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
            w = csv.DictWriter(out, RECORD)
            w.writeheader()
            w.writerows(rows)
        (tmp_path / "results" / "claims.yaml").write_text(claim)
        write_doc(f, tmp_path / "results.md", tmp_path / "runs", last=1)
        line = next(x for x in (tmp_path / "results.md").read_text().splitlines() if x.startswith("| fedper |"))
        return line.split(" | ")[-2]

    cost = "fedper: {baseline: fedavg, judge: global, measure: mib_to_target, target: 0.9, direction: below, claim: x}"
    assert verdict(cost) == "[no](#claim-fedper)"
    assert "MiB sent to 90 % of fedavg's accuracy, fewer claimed" in (tmp_path / "results.md").read_text()
    assert verdict(cost.replace("mib_to_target", "rounds_to_target")) == "[yes](#claim-fedper)"
    assert verdict(cost, with_mib=False) == "-"


def test_the_processor_names_the_instruction_set_torch_uses():
    """Two "AMD EPYC" machines, one with AVX512, give other bits (issue 84): the processor
    a run records says which vector kernels torch chose (ATEN_CPU_CAPABILITY lowers them)."""
    code = "from raysim.runtime.determinism import processor; print(processor('cpu'))"
    low = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": "default"})
    assert low.returncode == 0 and low.stdout.strip().endswith("(DEFAULT)"), low.stderr


def test_a_speed_claim_is_read_in_rounds_to_a_target_and_a_two_sided_claim_on_both_columns(tmp_path):
    """Issue 84: a claim of fewer rounds is read as the rounds each run takes to reach a share
    of the baseline's accuracy (here 90 % of FedAvg's final 0.90: 0.81), paired over seeds;
    `judge: both` (FedRoD's generic and personal halves) says yes only where both columns do;
    `also_against` shows a second baseline's verdict beside the first. Worked by hand:
    FedAvg reaches 0.81 at rounds 15, 15, 10; FedPer at 5, 5, 5: differences -10, -10, -5,
    t = -5.0 with 2 df, p = 0.038: fewer rounds, a yes."""
    from raysim.errors import ConfigError
    from raysim.results.published import RECORD, write_doc

    f = tmp_path / "table.yaml"
    f.write_text(SWEEP.replace("seed: [0]", "seed: [0, 1, 2]").replace("[fedavg, fedper]", "[fedavg, fedper, fedrep]"))
    (tmp_path / "results").mkdir()
    glob = {"fedavg": ["5:0.5000 10:0.8000 15:0.9000", "5:0.5000 10:0.8000 15:0.9000", "5:0.5000 10:0.8200 15:0.9000"],
            "fedper": ["5:0.8500 10:0.5000 15:0.5000", "5:0.8600 10:0.5100 15:0.5000", "5:0.8700 10:0.5000 15:0.5200"],
            "fedrep": ["5:0.1000 10:0.1000 15:0.1000"] * 3}
    own = {"fedavg": [0.60, 0.62, 0.64], "fedper": [0.80, 0.81, 0.83], "fedrep": [0.90, 0.91, 0.93]}
    rows = [{"setting": "digits", "algorithm": a, "seed": str(s), "status": "finished", "model_sha256": f"{s}{a}".ljust(64, "0"),
             "accuracy_curve": glob[a][s], "per_client_curve": f"15:{own[a][s]:.4f}"} for a in glob for s in range(3)]
    with (tmp_path / "results" / "runs.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, RECORD)
        w.writeheader()
        w.writerows(rows)
    claims = tmp_path / "results" / "claims.yaml"

    def verdict(text: str, who: str = "fedper") -> str:
        claims.write_text(text)
        write_doc(f, tmp_path / "results.md", tmp_path / "runs", last=1)
        line = next(x for x in (tmp_path / "results.md").read_text().splitlines() if x.startswith(f"| {who} |"))
        return line.split(" | ")[-2]

    assert verdict("fedper: {baseline: fedavg, judge: global, measure: rounds_to_target, target: 0.9, "
                   "direction: below, claim: fewer rounds}") == "[yes](#claim-fedper)"
    assert "(below fedavg, global; rounds to 90 % of fedavg's accuracy, fewer claimed): fewer rounds" in \
        (tmp_path / "results.md").read_text()
    # its final accuracy is under FedAvg's (0.50 against 0.90): read on accuracy, the same claim is a no
    assert verdict("fedper: {baseline: fedavg, judge: global, direction: above, claim: x}") == "[no](#claim-fedper)"
    # both halves: per client above FedAvg (yes), globally under it (no): no
    assert verdict("fedper: {baseline: fedavg, judge: both, claim: x}") == "[no](#claim-fedper)"
    assert verdict("fedper: {baseline: fedavg, judge: own, claim: x}") == "[yes](#claim-fedper)"
    # a second baseline beside the first: FedRep per client above FedAvg and above FedPer
    assert verdict("fedrep: {baseline: fedavg, judge: own, also_against: fedper, claim: x}", "fedrep") == \
        "[yes](#claim-fedrep); vs fedper: yes"
    # a cost claim's second baseline (Local, which sends nothing) is read on accuracy, above
    assert verdict("fedrep: {baseline: fedavg, judge: own, measure: rounds_to_target, target: 0.9, direction: below, "
                   "also_against: fedper, claim: x}", "fedrep").endswith("; vs fedper: yes")
    assert "also against fedper (on accuracy)" in (tmp_path / "results.md").read_text()
    for bad, says in (("{baseline: fedavg, judge: own, claim: x, target: 0.9}", "target (a fraction in (0, 1]"),
                      ("{baseline: fedavg, judge: own, claim: x, measure: rounds_to_target, target: 2}", "got 2"),
                      ("{baseline: fedavg, judge: own, claim: x, measure: speed}", "measure must be one of accuracy"),
                      ("{baseline: fedavg, judge: own, claim: x, also_against: local}", "also_against names 'local'"),
                      ("{baseline: fedavg, judge: own, claim: x, vs: fedrep}", "unknown key(s) vs")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            verdict(f"fedper: {bad}\n")
