"""Bad input through the real CLI: one clear line on stderr, exit code != 0, nothing written."""
import subprocess
import sys

import pytest

from raysim.run import main

CASES = [
    (["dataset=nope"], "dataset='nope' is not a known dataset; choose one of: "),  # (a test's plugin may add one)
    (["algorithm=fedfoo"], "algorithm='fedfoo' is not a known algorithm; choose one of: apfl, ccvr, creff, ditto, fed2, fedala, fedasync, fedavg"),
    (["model=transformer"], "model='transformer' is not a known model"),
    (["resources.server_threads=-1"], "resources.server_threads must be >= 0 (0: every CPU), got -1"),
    (["eval.local_clients=-2"], "eval.local_clients must be >= 0 (0: every client), got -2"),
    (["partition=zipf"], "partition.name='zipf' is not a known partition"),
    (["participation=1.5"], "participation must be in (0, 1], got 1.5"),
    (["local.clip_grad_norm=0"], "local.clip_grad_norm must be > 0 (or null: no clipping), got 0"),
    (["local.clip_grad_norm=10", "local.vectorize=true"], "local.clip_grad_norm with local.vectorize: the vectorised "
     "groups do not clip"),
    (["local.clip_grad_norm=10", "privacy.mode=local"], "local.clip_grad_norm with privacy.mode=local: DP-SGD clips "
     "each sample's gradient to privacy.clip instead"),
    (["local.vectorize=true", "algorithm=moon"], "local.vectorize: algorithm 'moon' trains its clients one at a time; "
                                                 "vectorised: ccvr, fedavg, fedavg_taunorm"),
    (["local.vectorize=true", "local.augment=crop_flip"], "local.vectorize does not combine with local.augment=crop_flip"),
    (["participation=0"], "participation must be in (0, 1], got 0"),
    (["partition.beta=0"], "partition.beta must be > 0"),

    (["no_such_key=1"], "unknown config key 'no_such_key'"),
    (["local.lrr=0.1"], "unknown config key 'local.lrr'"),
    (["rounds=many"], "bad value for config key 'rounds'"),
    (["local.lr=inf"], "local.lr=inf is not a finite number"),
    (["run_name=../../x"], "run_name='../../x' must be a plain folder name inside output_dir"),
    (["seed=-1"], "seed must be in [0, 2**32), got -1"),
    (["dataset=synthetic", "num_clients=1000000"], "1000000 clients with FedProx's log-normal sizes make"),
    (["ray.num_cpus=0"], "ray.num_cpus must be >= 1"),
    (["algorithm=fed2", "model=cnn"], "fed2 adapts the structure of mobilenet, vgg11, vgg16, vgg9; model='cnn'"),
    (["algorithm=fed2", "fed2.norm=layer"], "fed2.norm must be one of none, batch, group, got 'layer'"),
    (["algorithm=fed2", "model_options.groups=4"], "model_options.groups is set by fed2's section"),
    (["model=vgg9", "model_options.norm=instance"], "model_options.norm must be one of none, batch, group"),
]


# Checks the server makes once Ray is up (data, placement): the same `main` in this process,
# on the session's Ray (the CASES above have one, in its own process and Ray: the last).
SERVER_CASES = [
    (["model=cnn"], "model='cnn' does not fit dataset 'digits'"),
    (["resources.num_gpus_per_actor=0.5"], "client actors need 1 CPU + 0.5 GPU each, but this machine's Ray can hold 0"),
]


@pytest.mark.parametrize("args,message", SERVER_CASES, ids=[" ".join(a) for a, _ in SERVER_CASES])
def test_bad_input_the_server_finds_gives_one_clear_line(ray_local, tmp_path, capfd, args, message):
    assert main([*args, f"output_dir={tmp_path / 'runs'}", "--quiet"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "runs").exists()


# Checks on the data: a run makes them in its server once Ray is up (the CASES above that
# need data go that way); --show-partition makes the same ones (experiment.prepare) in the
# CLI's own process, which tests them here without a Ray start each.
DATA_CASES = [
    (["local.vectorize=true", "model=vgg9", "model_options.norm=batch"],
     "local.vectorize: model='vgg9' keeps buffers (encoder.0.1.running_mean"),
    (["partition=classes", "partition.k=11"], "partition.k=11 is more than the dataset's 10 classes"),
    (["num_clients=5000"], "num_clients=5000 is more than the 1437 training samples"),
    (["partition=natural"], "partition 'natural' needs a dataset with natural users"),
    (["dataset=mnist", "download=false", "data_dir=/nonexistent"], "files not found under /nonexistent/MNIST/raw"),
    (["model=resnet8", "dataset=synthetic", "partition=natural"], "model='resnet8' does not fit dataset 'synthetic'"),
    (["algorithm=fed2", "fed2.groups=11"], "model='vgg9' (fed2 adapts it) does not fit dataset 'digits' with inputs (1, 8, 8) (grouping needs 2 <= grouped_layers <= 9 (the model's layers) and 2 <= groups <= 10 (the classes), got grouped_layers=6, groups=11"),
]


def cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "raysim.run", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def main_here(args: list, capfd) -> tuple[int, str]:
    """The CLI's `main` in this process (no interpreter start, no torch import: 2-3 s saved
    per case); its exit code and stderr without the start-up progress lines."""
    code = main(args)
    err = "".join(line for line in capfd.readouterr().err.splitlines(True) if not line.startswith("raysim ["))
    return code, err


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_gives_one_clear_line(tmp_path, capfd, args, message):
    code, err = main_here([*args, f"output_dir={tmp_path / 'runs'}"], capfd)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_the_command_prints_one_line_for_an_error_found_once_ray_is_up(tmp_path):
    """`python -m raysim.run` itself, with its own local Ray: what the user sees is the one
    line, nothing of Ray's, and the local Ray is stopped."""
    r = cli(["resources.clients_per_actor=1", "resources.num_cpus_per_actor=1", "num_clients=4", "ray.num_cpus=2",
             f"output_dir={tmp_path / 'runs'}"], tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("raysim [")]  # progress
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == ("error: resources: 4 client actors need 1 CPU each, but this machine's Ray can hold 2 (2 CPUs, "
                        "0 GPUs); lower resources.num_cpus_per_actor / num_gpus_per_actor or use fewer actors "
                        "(resources.num_actors, resources.clients_per_actor)"), lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args,message", DATA_CASES, ids=[" ".join(a) for a, _ in DATA_CASES])
def test_bad_data_settings_give_one_clear_line(capfd, args, message):
    code, err = main_here(["--show-partition", "--quiet", *args], capfd)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ") and message in err, err


def test_checks_that_need_no_data_answer_before_ray_starts(tmp_path):
    """With Ray unable to start (its temp folder under a file), a config problem is still
    the one line: it was found before Ray was asked to start."""
    import os

    (tmp_path / "a-file").write_text("")
    no_ray = dict(os.environ, RAY_TMPDIR=str(tmp_path / "a-file" / "ray"))
    for args, message in ((["algorithm=fedfoo"], "algorithm='fedfoo' is not a known algorithm"),
                          ([f"output_dir={tmp_path / 'a-file' / 'runs'}"], "a-file is a file, not a folder"),
                          (["algorithm=fedprox", "fedprox.mu=-1"], "fedprox.mu must be >= 0")):
        r = subprocess.run([sys.executable, "-m", "raysim.run", *args], capture_output=True, text=True,
                           cwd=tmp_path, timeout=120, env=no_ray)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_a_bad_config_found_while_ray_starts_leaves_no_ray_behind(tmp_path, ray_tmp):
    """The command checks its config in a forked child while it starts Ray (launch.CheckApart):
    a config the check refuses, whether Ray is up by then or not, is the one line, exit 2,
    and every process of the Ray it was starting is gone."""
    import os

    import own_ray
    import psutil

    env = dict(os.environ, RAY_TMPDIR=ray_tmp)
    for args, message in ((["algorithm=fedprox", "fedprox.mu=-1"], "fedprox.mu must be >= 0"),
                          (["rounds=1", "fedprox.mu=1"], "fedprox.* is set but algorithm=fedavg does not read")):
        r = subprocess.run([sys.executable, "-m", "raysim.run", *args, f"output_dir={tmp_path / 'runs'}"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    _, alive = psutil.wait_procs(own_ray.under(ray_tmp), timeout=10)  # killed ones may take a moment to be reaped
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    assert not (tmp_path / "runs").exists()


def test_an_address_where_nothing_listens_fails_at_once(tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli([f"ray.address=127.0.0.1:{port}", f"output_dir={tmp_path / 'runs'}", "--quiet"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"ray.address='127.0.0.1:{port}': nothing answers at 127.0.0.1:{port}" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 5\nlocal:\n  lr: [0.1\n")
    r = cli(["--config", str(bad)], tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and f"malformed YAML in {bad}" in r.stderr and "line" in r.stderr


def test_missing_config_file(tmp_path):
    r = cli(["--config", "nope.yaml"], tmp_path)
    assert r.returncode == 2 and "config file 'nope.yaml' not found" in r.stderr


def test_print_config_and_list(tmp_path):
    r = cli(["--print-config", "algorithm=fedprox", "fedprox.mu=0.1", "partition=classes"], tmp_path)
    assert r.returncode == 0
    assert "algorithm: fedprox" in r.stdout and "mu: 0.1" in r.stdout and "name: classes" in r.stdout
    r = cli(["--list"], tmp_path)
    assert r.returncode == 0 and "fedavgm" in r.stdout and "resnet8" in r.stdout and "power_law" in r.stdout


def test_show_partition_table(tmp_path):
    r = cli(["--show-partition", "partition=classes", "partition.k=2", "num_clients=10"], tmp_path)
    assert r.returncode == 0
    rows = [l.split() for l in r.stdout.splitlines()[1:11]]
    assert all(sum(1 for v in row[1:11] if v != "0") == 2 for row in rows)


def test_every_shipped_config_file_loads():
    from pathlib import Path

    from raysim.config import load_config

    configs = Path(__file__).parent.parent / "configs"
    files = sorted(f for f in configs.rglob("*.yaml") if f.parent.name != "sweeps")  # sweeps: test_workflow.py
    assert len(files) > 10
    for f in files:
        load_config([str(f)])  # raises ConfigError on a bad key or value


def test_resume_errors_name_the_run_and_the_key(tmp_path):
    r = cli(["resume=nowhere"], tmp_path)
    assert r.returncode == 2 and "resume='nowhere': no run there" in r.stderr and "Traceback" not in r.stderr
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text("rounds: 3\n")
    r = cli([f"resume={old}", "seed=3"], tmp_path)
    assert r.returncode == 2 and "resume: seed cannot change when resuming" in r.stderr
    r = cli([f"resume={old}"], tmp_path)  # a run without a checkpoint
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no checkpoint" in r.stderr, r.stderr
    assert sorted(p.name for p in old.iterdir()) == ["config.yaml"]  # nothing written


class _Payload:
    """What a crafted checkpoint carries: unpickling it would run a shell command."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.target}",)


def test_resume_never_runs_code_from_a_checkpoint(tmp_path):
    import torch

    run = tmp_path / "shared-run"
    run.mkdir()
    (run / "config.yaml").write_text("rounds: 3\n")
    pwned = tmp_path / "PWNED"
    torch.save({"round": 1, "algorithm": _Payload(pwned)}, run / "checkpoint.pt")
    r = cli([f"resume={run}"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "safe loader refuses" in lines[0] and "checkpoint.pt" in lines[0], r.stderr
    assert not pwned.exists()  # the command never ran
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt", "config.yaml"]  # nothing written
    (run / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")  # a corrupt file: one line too
    r = cli([f"resume={run}"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a readable checkpoint" in r.stderr, r.stderr


@pytest.mark.parametrize("override", ["fedprox.mu=nan", "fedavgm.server_lr=nan", "synthetic.alpha=nan",
                                      "partition.beta=.inf", "system.dropout=nan", "local.momentum=-.inf"])
def test_non_finite_numbers_are_refused_by_name(override):
    """NaN passes every check written as `x < 0`: a generic pass refuses any non-finite number."""
    from raysim.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}=.* is not a finite number"):
        load_config(overrides=[override])


def test_the_command_line_checks_its_config_without_importing_torch(tmp_path):
    """The check imports every algorithm's module (torch: ~500 MB); the command runs it in a
    forked child, so the command's own process never holds torch, and its errors are the same."""
    import subprocess
    import sys

    probe = ("import sys; from raysim.launch import check_apart; "
             "layers, cfg = check_apart([], ['algorithm=fedprox', 'fedprox.mu=0.5']); "
             "print(cfg.fedprox.mu, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["0.5", "False"], r.stderr
    bad = ("from raysim.launch import check_apart; from raysim.config import ConfigError\n"
           "try:\n    check_apart([], ['fedprox.mu=-1', 'algorithm=fedprox'])\n"
           "except ConfigError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.stdout.strip() == "fedprox.mu must be >= 0, got -1.0", r.stderr
