"""Hardening, part 5 (issue 85), through the real CLI and tools: one process a run
directory, the files the sweep and table tools read, signals at start-up, options read by
nothing, and limits that were not checked."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = ["dataset=digits", "model=mclr", "num_clients=6", "local.epochs=1"]


def cli(args: list, cwd, timeout: float = 180, module: str = "raysim.run", **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, **kw)


def one_error(r: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one line a refused command prints (progress lines aside)."""
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("raysim [")]
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


# ---------------------------------------------------------------- one process a run directory
def test_a_resume_of_a_run_its_first_process_still_drives_is_refused(tmp_path):
    """Only resumed runs took the lock: `resume=DIR` of a run still in its first process was
    accepted, both drove the directory, and the first died writing its checkpoint."""
    run = tmp_path / "runs" / "r"
    first = subprocess.Popen([sys.executable, "-m", "raysim.run", *SMALL, "rounds=400", "run_name=r",
                              f"output_dir={tmp_path / 'runs'}", "--quiet"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 150
        while not (run / "checkpoint.pt").exists():  # a round has ended: a resume would find a checkpoint
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = cli([f"resume={run}", "--quiet"], tmp_path, timeout=120)
        assert f"{run} is in use: process {first.pid} on " in one_error(second), second.stderr
        assert first.poll() is None  # the first goes on, untouched
    finally:
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    assert first.returncode == 130 and f"resume={run}" in err, err  # stopped cleanly, lock given back
    assert not (run / ".lock").exists()


# ---------------------------------------------------------------- the files the sweep and table tools read
GRID = {"seed": [0], "setting": [{"label": "d", "dataset": "digits"}], "algorithm": ["fedavg", "fedprox"]}
FIXED = {"model": "mclr", "rounds": 1, "num_clients": 4}


def sweep_file(tmp_path, **sections) -> Path:
    f = tmp_path / "s.yaml"
    f.write_text(json.dumps({"fixed": FIXED, "grid": GRID, **sections}))
    return f


def refused_sweep(tmp_path, *args, **sections) -> str:
    r = cli(["--file", str(sweep_file(tmp_path, **sections)), "--output-dir", str(tmp_path / "out"), *args],
            tmp_path, module="raysim.sweep", timeout=120)
    line = one_error(r)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.yaml"))
    return line


@pytest.mark.parametrize("tune, says", [
    ({"validation": "abc"}, "tune.validation must be a number, got 'abc'"),
    ({"last": 2.5}, "tune.last must be a whole number, got 2.5"),
    ({"judge_by_setting": ["own"]}, "tune.judge_by_setting must be a mapping, got ['own']"),
    ({"grid": ["local.lr"]}, "tune.grid must be a mapping"),
    ({"otherwise": ["local.epochs"]}, "tune.otherwise must be a mapping"),
])
def test_a_tune_section_of_the_wrong_type_is_one_line(tmp_path, tune, says):
    """validation: abc was a ValueError traceback (the casts ran outside any check)."""
    assert says in refused_sweep(tmp_path, tune={"grid": {"local.lr": [0.1]}, **tune})


@pytest.mark.parametrize("score, says", [("zero", "line 2: score 'zero' is not a number"),
                                         ("7", "line 2: score 7.0 is not an accuracy in [0, 1]")])
def test_a_tuned_csv_with_a_bad_score_is_one_line_naming_its_line(tmp_path, score, says):
    tuned = tmp_path / "tuning.csv"
    tuned.write_text(f"setting,algorithm,point,score,chosen\nd,fedavg,lr=0.1,{score},1\n")
    line = refused_sweep(tmp_path, "--tuned", str(tuned), tune={"grid": {"local.lr": [0.1]}})
    assert f"--tuned {tuned}, {says}" in line, line


RUNS_HEADER = "setting,algorithm,seed,final_accuracy,status,model_sha256,accuracy_curve\n"


@pytest.mark.parametrize("runs, says", [
    (RUNS_HEADER + "d,fedavg,0,zero point five,finished,ab,\n", "line 2: final_accuracy 'zero point five' is not a number"),
    (RUNS_HEADER + "d,fedavg,0,0.5,finished,ab,1:0.2 x:0.3\n", "line 2: accuracy_curve entry 'x:0.3' is not round:accuracy"),
    (RUNS_HEADER + "d,fedavg,0,0.5,finished,ab,1:0.2 2:1.3\n", "line 2: accuracy_curve entry '2:1.3' is not round:accuracy"),
    ("setting,algorithm,seed,status,model_sha256\nd,fedavg,0,finished,ab\n", "no column final_accuracy"),
])
def test_a_runs_csv_with_a_bad_field_or_no_final_accuracy_is_one_line_before_anything_runs(tmp_path, runs, says):
    """A bad number or curve was a ValueError traceback; a runs.csv without final_accuracy passed
    the reader and --verify re-ran a row before dying in statistics.mean([])."""
    doc = tmp_path / "doc.md"
    (tmp_path / "doc").mkdir()
    (tmp_path / "doc" / "runs.csv").write_text(runs)
    f = sweep_file(tmp_path)
    for extra in ([], ["--verify", "1"]):
        r = cli(["--sweep", str(f), "--doc", str(doc), *extra], tmp_path, module="raysim.results.table", timeout=120)
        line = one_error(r)
        assert f"{tmp_path / 'doc' / 'runs.csv'}" in line and says in line, line
        assert "verify 1/1" not in r.stderr + r.stdout and not doc.exists()


def test_verify_with_no_rows_to_draw_is_one_line(tmp_path):
    """--verify -1 was "Sample larger than population or is negative" (a traceback)."""
    (tmp_path / "doc").mkdir()
    (tmp_path / "doc" / "runs.csv").write_text(RUNS_HEADER + "d,fedavg,0,0.5,finished,ab,1:0.5\n")
    for n in ("-1", "0"):
        r = cli(["--sweep", str(sweep_file(tmp_path)), "--doc", str(tmp_path / "doc.md"), "--verify", n], tmp_path,
                module="raysim.results.table", timeout=120)
        assert f"--verify {n}: the number of rows to re-run must be 1 or more" in one_error(r)


def test_a_sweep_output_dir_that_is_a_file_is_one_line(tmp_path):
    """NotADirectoryError traceback before; raysim.run refuses the same output_dir in one line."""
    (tmp_path / "out").write_text("")
    r = cli(["--file", str(sweep_file(tmp_path)), "--output-dir", str(tmp_path / "out")], tmp_path,
            module="raysim.sweep", timeout=120)
    assert f"{tmp_path / 'out'} is a file, not a folder" in one_error(r)


def test_an_only_entry_with_two_lists_is_refused_even_beside_one_with_none(tmp_path):
    """Two entries, one with two lists and one with none, passed the count of lists and were
    paired with the wrong axes (the message then blamed a valid value)."""
    line = refused_sweep(tmp_path, only=[{"seed": [0], "algorithm": ["fedavg"]}, {"seed": 0}])
    assert "only must be a list of mappings" in line and "with one list each" in line, line


def test_a_cells_key_that_does_not_exist_is_refused_when_its_points_are_all_skipped(tmp_path):
    """`cells` setting nosuch.key for a cell `skip` removes was never checked: the sweep ran."""
    line = refused_sweep(tmp_path, skip=[{"algorithm": "fedprox"}],
                         cells=[{"algorithm": "fedprox", "set": {"nosuch.key": 1}}])
    assert "unknown config key 'nosuch'" in line and "cells entry setting nosuch.key=1" in line, line


# ---------------------------------------------------------------- signals
def signalled(tmp_path, name: str, args: list, sig, when) -> tuple:
    """Run the command, send `sig` when `when` comes (seconds after the start; "handlers": as
    soon as it has its signal handlers; the start of a progress line; "checkpoint": the run's
    first checkpoint written), and return (exit
    code, its lines but the progress ones, the run directory). Fails past 30 s after the
    signal."""
    import threading

    out = tmp_path / name
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *args, "run_name=r", f"output_dir={out}"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, seen = [], threading.Event()

    def read():
        for line in p.stderr:
            lines.append(line.rstrip("\n"))
            if isinstance(when, str) and f"] {when}" in line:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + 120
    if isinstance(when, float):
        time.sleep(when)
    elif when == "handlers":  # the first moment raysim's own handlers are in place (Python's start-up before)
        while not catches_sigterm(p.pid):
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.002)
    else:
        while not (seen.is_set() if when != "checkpoint" else (out / "r" / "checkpoint.pt").exists()):
            assert p.poll() is None and time.time() < deadline, (when, lines)
            time.sleep(0.01)
    p.send_signal(sig)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"{sig.name} at {when!r}: still running 30 s later")
    reader.join(10)
    said = [line.split("\r")[-1] for line in lines]
    # progress: "raysim [ t s] ...", the bar, and "raysim: waiting for k of n client actors" (every 10 s while
    # they start: seen once, on 2 cores beside a sweep, before a signal at "run directory:")
    return p.returncode, [x for x in said if x.strip() and not x.startswith(("raysim [", "raysim: waiting for "))
                          and "round/s" not in x and "it/s" not in x and "%|" not in x], out / "r"


def catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


MOMENTS = ["handlers", 0.2, 0.5, 1.0, "the server runs in this process", "run directory:", "checkpoint"]


@pytest.mark.parametrize("sig, rounds, moments", [
    (signal.SIGINT, 600, MOMENTS),  # trained in this process
    (signal.SIGTERM, 20000, [*MOMENTS, "starting a local Ray", "data ready"]),  # on a local Ray's actors
])
def test_a_signal_at_any_moment_of_start_up_or_run_ends_the_command_in_seconds_with_one_true_line(tmp_path, sig,
                                                                                                   rounds, moments):
    """One Ctrl-C while the command started could hang it for good (raised inside Python's
    import lock while the check thread imported torch); a SIGTERM at start-up once ended
    with a traceback; a SIGTERM a few rounds in once said "nothing was written" beside a run
    directory holding rounds and a checkpoint. Signals at many moments, from the first
    imports to the rounds: each ends the command within seconds, exit 130, one line, that
    says "nothing was written" only where no round was written and names resume=DIR where
    one was. 600 rounds train in this process (no Ray), 20,000 on a local Ray's actors."""
    for i, when in enumerate(moments):
        code, lines, run = signalled(tmp_path, f"runs{i}", [*SMALL, f"rounds={rounds}", "checkpoint_every=1"], sig,
                                     when)
        assert code == 130 and len(lines) == 1 and "Traceback" not in lines[0], (when, code, lines)
        if (run / "checkpoint.pt").exists():
            assert f"resume={run}" in lines[0], (when, lines)
        elif run.exists():
            assert f"{run} holds no round to resume from" in lines[0], (when, lines)
        else:
            assert "nothing was written" in lines[0], (when, lines)
        if when == "checkpoint":
            assert f"resume={run}" in lines[0]


@pytest.mark.parametrize("override, named", [("fedprox.mu=1e30", "fedprox.mu=1e+30 (1e+32 times its default 0.01)"),
                                             ("server.lr=1e30", "server.lr=1e+30 (1e+30 times its default 1)")])
def test_the_divergence_hint_names_the_number_set_far_past_its_default(tmp_path, override, named):
    """The hint named local.lr and local.momentum whatever the cause (the issue's 1e300 and
    1e308 are past float32 now: refused before the run, see below)."""
    r = cli([*SMALL, "algorithm=fedprox", override, "rounds=3", f"output_dir={tmp_path}", "--quiet"], tmp_path)
    line = one_error(r, code=3)
    assert "diverged" in line and f"The config sets {named}: try it smaller" in line, line


# ---------------------------------------------------------------- options read by nothing, limits
@pytest.mark.parametrize("overrides, says", [
    (["algorithm=heterofl", "heterofl.roll=code"], "heterofl.roll is set but this run does not read it: it is read "
                                                   "only with heterofl.variant=fedrolex (here heterofl.variant=heterofl)"),
    (["compress.up=qsgd", "compress.sign_scale=tensor"], "compress.sign_scale is set but this run does not read it: "
                                                         "it is read only with compress.up=sign (here compress.up=qsgd)"),
    (["compress.sign_scale=tensor"], "it is read only with compress.up=sign (here compress.up=none)"),
    (["compress.up=topk", "compress.bucket=8"], "compress.bucket is set but this run does not read it"),
    (["eval.local_clients=5", "partition.test_fraction=0"], "eval.local_clients is set but this run does not read it: "
                                                            "it is read only with clients' own test data"),
])
def test_an_option_the_run_does_not_read_is_refused_on_the_command_line_and_noted_from_a_file(tmp_path, overrides,
                                                                                               says):
    """heterofl.roll=code with variant heterofl, compress.sign_scale with another codec and
    eval.local_clients without local test splits gave the same bits as without, silently."""
    from raysim.config import ConfigError, describe_layers, load_config, read_layers, resolve

    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert says in str(e.value), str(e.value)
    # the same keys from a --config file (one file may serve several runs): a note, the run goes
    choosing = [o for o in overrides if o.split("=")[0] in ("algorithm", "compress.up", "partition.test_fraction")]
    unread = [o for o in overrides if o not in choosing]
    f = tmp_path / "c.yaml"
    nested: dict = {}
    for o in unread:
        section, key = o.split("=")[0].split(".")
        nested.setdefault(section, {})[key] = json.loads(o.split("=")[1]) if o.split("=")[1][0].isdigit() else \
            o.split("=")[1]
    f.write_text(json.dumps(nested))
    layers = read_layers([str(f)], choosing)
    notes = describe_layers(layers, resolve(layers))
    key = unread[0].split("=")[0]
    assert any(line.startswith(f"note: {f} sets {key}, which this run does not read") for line in notes), notes


@pytest.mark.parametrize("override", ["local.lr=1e300", "local.weight_decay=1e39", "server.lr=-1e39"])
def test_a_number_past_float32_is_refused_before_anything_runs(override):
    """local.lr=1e300 passed the checks and the run died in its first step (exit 1, a run
    directory left); lr=1e30 stops cleanly as diverged."""
    from raysim.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}=.* is not a finite number of float32's range"):
        load_config(overrides=[override])
    load_config(overrides=["local.lr=1e30"])  # within float32: the run's to find out


def test_a_qsgd_bucket_past_the_update_is_one_bucket_of_its_size():
    """compress.bucket=2e8 padded each 55k-entry update to 2e8 floats (4.7 GB); 1e9 ran past
    300 s. A bucket larger than the update is the update: the same message as bucket = n."""
    import torch

    from raysim.compression.codecs import QSGD

    v = torch.randn(55_000, generator=torch.Generator().manual_seed(0))
    big = QSGD(4, 10**9).encode(v, torch.Generator().manual_seed(1))
    exact = QSGD(4, 55_000).encode(v, torch.Generator().manual_seed(1))
    assert len(big.parts["norms"]) == 1 and big.nbytes == exact.nbytes
    assert (big.parts["codes"] == exact.parts["codes"]).all()
    assert torch.equal(QSGD(4, 10**9).decode(big), QSGD(4, 55_000).decode(exact))


def test_fedrod_with_a_large_gamma_trains_instead_of_overflowing(tmp_path):
    """fedrod.gamma of ~23 and up on digits: counts.pow(gamma) overflowed float32 and the run
    stopped as diverged telling the user to lower local.lr; gamma x log n_c does not."""
    r = cli([*SMALL, "algorithm=fedrod", "fedrod.gamma=30", "rounds=2", f"output_dir={tmp_path}", "--quiet"], tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(next(tmp_path.glob("*/summary.json")).read_text())["status"] == "finished"


@pytest.mark.parametrize("algorithm, kept", [("apfl", "v"), ("pfedme", "theta")])
def test_clip_grad_norm_clips_the_personal_models_steps_too(algorithm, kept):
    """local.clip_grad_norm clipped w's steps but not APFL's v or pFedMe's theta (at 1e-9,
    APFL's global model stayed at chance while v trained). Clipped to 1e-9, neither moves."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from test_personal import server_for

    from raysim.training import cpu_state

    for clip, moves in ((None, True), (1e-9, False)):
        s = server_for(algorithm, "local.epochs=2", "local.batch_size=8",
                       *([f"local.clip_grad_norm={clip}"] if clip else []))
        w = cpu_state(s.algorithm.model)
        start = {k: t - 0.2 for k, t in w.items()} if algorithm == "apfl" else w
        if algorithm == "apfl":
            s.states[0] = {"v": dict(start), "alpha": 0.3}
        s.run_clients(1, [0], s.algorithm.broadcast(1))
        moved = max(float((s.states[0][kept][k] - start[k]).abs().max()) for k in w)
        assert (moved > 1e-3) == moves, (clip, moved)


# ---------------------------------------------------------------- populations
@pytest.mark.parametrize("generate", ["lazy", "all"])
def test_an_empty_global_test_set_is_refused_before_round_1(tmp_path, generate):
    """Users with 2 samples at synthetic.test_fraction 0.2: no test sample; the run exited 0
    reporting "final accuracy 0.0000"."""
    r = cli(["dataset=synthetic", "partition=natural", "model=mclr", "num_clients=50", "synthetic.samples_per_client=2",
             f"synthetic.generate={generate}", "rounds=2", f"output_dir={tmp_path / 'runs'}", "--quiet"], tmp_path)
    line = one_error(r)
    assert "the global test set is empty" in line and "synthetic.test_fraction=0.2 of a client's 2 to 2 samples" in line
    assert not (tmp_path / "runs").exists()


def test_a_selection_that_reads_every_client_is_refused_on_a_lazy_population_of_hundreds_of_thousands():
    """selection=fedentopt on a lazy population made every user's label counts before round
    1, silently: 110 s for 200,000 users, hours at the README's 15 million."""
    from raysim.config import ConfigError, load_config

    lazy = ["dataset=synthetic", "partition=natural", "synthetic.generate=lazy", "synthetic.samples_per_client=20",
            "synthetic.test_users=100", "eval.local_clients=10"]
    with pytest.raises(ConfigError, match="selection=fedentopt reads every client's label counts before round 1"):
        load_config(overrides=[*lazy, "num_clients=200000", "selection=fedentopt"])
    load_config(overrides=[*lazy, "num_clients=200000"])  # random selection: O(picked clients)
    load_config(overrides=[*lazy, "num_clients=2000", "selection=fedentopt"])


def test_show_partition_plot_of_a_lazy_population_draws_the_users_it_lists(tmp_path):
    """--show-partition lists a lazy population's first 1,000 users; --plot made all of them
    (60 s for 200,000; ~40 min at 15 M) and drew every client."""
    r = cli(["dataset=synthetic", "partition=natural", "model=mclr", "num_clients=20000", "synthetic.generate=lazy",
             "synthetic.samples_per_client=20", "--show-partition", "--plot", str(tmp_path / "p.png")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "partition picture: " in r.stderr and "(the first 1,000 users, as listed" in r.stderr, r.stderr
    assert (tmp_path / "p.png").stat().st_size > 0 and "19,000 more users" in r.stdout


# ---------------------------------------------------------------- defaults that cannot work
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


@pytest.mark.skipif(not FMNIST.is_file(), reason="Debian's dataset-fashion-mnist is not installed")
def test_pfedme_at_its_defaults_trains_the_zoos_cnn(tmp_path):
    """pFedMe at its defaults (personal_lr 0.09, the authors' MNIST value for an MLP) stopped
    as diverged in round 1 on the zoo's CNN, #C=2, lr 0.01, momentum 0.9 (MNIST and
    Fashion-MNIST): theta's step is stable only where personal_lr (L + lam) < 2, and the CNN's
    batch curvature L is 18-26. The default is PFLlib's 0.01; the authors' 0.09 still diverges."""
    setup = ["dataset=fmnist", "model=cnn", "algorithm=pfedme", "num_clients=20", "clients_per_round=2",
             "partition=classes", "partition.k=2", "partition.test_fraction=0.2", "local.lr=0.01",
             "local.momentum=0.9", "rounds=1", "--quiet"]
    r = cli([*setup, f"output_dir={tmp_path / 'a'}"], tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = cli([*setup, "pfedme.personal_lr=0.09", f"output_dir={tmp_path / 'b'}"], tmp_path)
    assert "pfedme diverged" in one_error(r, code=3) and "L under 7.22" in r.stderr


@pytest.mark.skipif(not FMNIST.is_file(), reason="Debian's dataset-fashion-mnist is not installed")
def test_perfedavg_at_its_defaults_beats_fedavgs_served_model_on_the_clients_tests(tmp_path):
    """Per-FedAvg at its defaults ended under FedAvg's served model on the clients' own tests
    (MNIST #C=2, the CNN, lr 0.01, momentum 0.9: 0.744 against 0.779, its meta-model at
    chance): its meta step, plain SGD at beta = local.lr, moved 10x less than FedAvg's
    momentum steps. beta now defaults to local.lr / (1 - local.momentum). Here (Fashion-MNIST
    #C=2, 10 rounds of 10 steps) 0.69 against FedAvg's 0.26 (beta = lr: 0.15)."""
    setup = ["dataset=fmnist", "model=cnn", "num_clients=20", "clients_per_round=10", "partition=classes",
             "partition.k=2", "partition.test_fraction=0.2", "local.lr=0.01", "local.momentum=0.9", "local.steps=10",
             "rounds=10", "eval_every=10", "--quiet"]  # the finals alone: evaluating every round was half its time
    got = {}
    for algorithm in ("fedavg", "perfedavg"):
        r = cli([*setup, f"algorithm={algorithm}", f"output_dir={tmp_path}", f"run_name={algorithm}"], tmp_path)
        assert r.returncode == 0, r.stderr
        got[algorithm] = json.loads((tmp_path / algorithm / "summary.json").read_text())
    served = got["fedavg"]["final_local_accuracy"]
    assert got["perfedavg"]["final_personal_accuracy"] > served + 0.2, (got["perfedavg"], served)
