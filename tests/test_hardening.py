"""Hardening, through the real CLI: a run directory carries no code, a resumed run is the
run its checkpoint was made with, a local Ray listens on loopback only, and a dead driver
or an unplaceable actor ends with one line instead of a traceback or a hang."""
import pytest
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import own_ray
import psutil
from own_ray import command_line

from raysim.run import main

SUPPORT = str(Path(__file__).parent / "support")
SMALL = ["dataset=digits", "model=mlp", "num_clients=6", "participation=0.5", "local.batch_size=32", "--quiet"]


def cli(args, cwd, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "raysim.run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def one_error_line(r) -> str:
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("raysim [")]  # progress
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_resume_imports_only_plugins_named_on_the_command_line(tmp_path):
    """A run directory's config.yaml may name any module; resuming imports none of them
    unless the user names the same modules on the command line."""
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "IMPORTED"
    (code / "stranger.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    run = tmp_path / "downloaded-run"
    run.mkdir()
    (run / "config.yaml").write_text("rounds: 3\nplugins: [stranger]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]))
    r = cli([f"resume={run}"], tmp_path, env)
    assert r.returncode == 2
    assert "lists plugins ['stranger']" in one_error_line(r) and "plugins=[stranger]" in r.stderr
    assert not marker.exists()  # the module never ran
    r = cli([f"resume={run}", "plugins=[other]"], tmp_path, env)
    assert r.returncode == 2 and not marker.exists()
    r = cli([f"resume={run}", "plugins=[stranger]"], tmp_path, env)  # the user vouches for it
    assert r.returncode == 2 and "no checkpoint" in one_error_line(r)
    assert marker.exists()
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_resume_refuses_an_edited_config_before_writing(ray_local, tmp_path):
    assert main([*SMALL, "rounds=2", f"output_dir={tmp_path}", "run_name=done"]) == 0
    for edit, message in ((("  lr: 0.05", "  lr: 0.5"), "local.lr was 0.05, is 0.5"),
                          (("algorithm: fedavg", "algorithm: fedprox"), "algorithm was 'fedavg', is 'fedprox'")):
        run = tmp_path / f"edited-{edit[1].split(':')[0].strip()}"
        shutil.copytree(tmp_path / "done", run)
        text = (run / "config.yaml").read_text()
        assert edit[0] in text
        (run / "config.yaml").write_text(text.replace(edit[0], edit[1]))
        before = snapshot(run)
        r = cli([f"resume={run}", "rounds=4"], tmp_path)
        assert r.returncode == 2 and message in one_error_line(r) and "no longer matches" in r.stderr
        assert snapshot(run) == before  # nothing written, config.yaml included


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _wait_for_checkpoint(p, run: Path) -> None:
    deadline = time.time() + 150
    while not (run / "checkpoint.pt").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if not (run / "checkpoint.pt").exists():
        p.kill()
        raise AssertionError(p.communicate(timeout=30)[1][-3000:])


@pytest.mark.slow
def test_local_run_is_loopback_only_unshadowed_and_survives_its_killed_command(ray_local, tmp_path):
    """One local run from a folder holding its own `algorithms/` package: its Ray listens on
    loopback only; one actor per client fits 2 CPUs (fractional shares); the server runs in
    the command's own process (no server actor); the command killed outright mid-run, its
    `resume=` finishes the run (here on the test session's Ray)."""
    (tmp_path / "algorithms").mkdir()
    marker = tmp_path / "SHADOWED"
    (tmp_path / "algorithms" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    run = tmp_path / "runs" / "r"
    args = [*SMALL, "num_clients=4", "participation=1.0", "plugins=[stateful_plugin]",
            "algorithm=test_slow_state_counter", "resources.clients_per_actor=1", "ray.num_cpus=2",
            "checkpoint_every=1", f"output_dir={tmp_path / 'runs'}", "run_name=r"]
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *args, "rounds=200"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(p, run)
        procs = _tree(p.pid)
        listening = set()
        for proc in procs:
            try:
                listening |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening
        assert sum("ray::ClientActor" in command_line(q) for q in procs) == 4  # 4 actors on 2 CPUs: 0.5 CPU each
        assert not any(command_line(q).startswith("ray::ServerActor") for q in procs)  # the server is the command's
        daemons = " ".join(command_line(q) for q in procs)  # the Dashboard off: no autoscaler or log monitor
        assert "raylet" in daemons and "log_monitor.py" not in daemons and "_private/monitor.py" not in daemons
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert main([f"resume={run}", "rounds=6", "plugins=[stateful_plugin]", "--quiet"]) == 0
    assert (run / "model.pt").exists()
    assert not marker.exists()  # the folder named `algorithms` was never imported


@pytest.mark.slow
def test_a_dead_server_actor_is_one_line_that_says_how_to_resume(ray_local, tmp_path):
    """A command that joins a Ray (`ray.address`) runs its server as an actor there; that
    actor's process killed mid-run ends the command with one line naming `resume=`."""
    from raysim.runtime import pool

    pool.release()  # the actors earlier tests' runs left to this session's Ray hold its CPUs
    run = tmp_path / "runs" / "r"
    address = ray_local.get_runtime_context().gcs_address
    args = [*SMALL, "num_clients=4", "participation=1.0", "plugins=[stateful_plugin]",
            "algorithm=test_slow_state_counter", f"ray.address={address}", "checkpoint_every=1",
            "resources.num_actors=1",  # beside what earlier tests left on the session's Ray
            f"output_dir={tmp_path / 'runs'}", "run_name=r", "rounds=200"]
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *args], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(p, run)
        server = own_ray.descendants("ray::ServerActor")
        assert len(server) == 1, [command_line(q) for q in server]
        server[0].send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: the server process died") and f"resume={run}" in lines[-1], err[-2000:]
    assert sum(line.startswith("error") for line in lines) == 1 and "Traceback" not in err


@pytest.mark.parametrize("when", ["resources.ray_start_s=0", "resources.ray_start_s=0.000001"])
def test_ray_that_cannot_start_is_one_line(tmp_path, when):
    """Ray started while the config is checked (always Ray), or after the data, when the
    clients' training would pay for it (runtime/here.py): either way one line, nothing written,
    exit 1 (a failure of the machine, not bad input: issue 85)."""
    (tmp_path / "a-file").write_text("")  # Ray's temp folder cannot be made under a file
    r = cli([*SMALL, "rounds=1", when, f"output_dir={tmp_path / 'runs'}"], tmp_path,
            env=dict(os.environ, RAY_TMPDIR=str(tmp_path / "a-file" / "ray")), timeout=120)
    assert r.returncode == 1 and "Ray did not start on this machine" in one_error_line(r)
    assert not (tmp_path / "runs").exists()


def test_a_corrupt_dataset_file_is_named_and_leaves_nothing(ray_local, tmp_path, capfd):
    """A download that saved an error page as a .gz: one line naming the file, no 0-byte
    unpacked file left to break the next run, no run directory."""
    import gzip

    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (raw / f"{f}.gz").write_bytes(gzip.compress(b"\0\0\x08\x01\0\0\0\0"))  # whole, empty IDX files
    (raw / "train-images-idx3-ubyte.gz").write_bytes(b"<html>503 Service Unavailable</html>")
    assert main(["dataset=mnist", "model=cnn", "download=false", f"data_dir={tmp_path / 'data'}", "rounds=1",
                 f"output_dir={tmp_path / 'runs'}", "--quiet"]) == 2  # found by the server, Ray up
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"{raw / 'train-images-idx3-ubyte.gz'} is not a whole gzip file" in err, err
    assert not (raw / "train-images-idx3-ubyte").exists() and not (tmp_path / "runs").exists()
