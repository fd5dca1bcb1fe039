"""Hardening, part 2 (issue 27), through the real CLI, the sweep command and the Python API:
Ctrl-C works at every moment, a wrong Ray address is one line within seconds, bad files are
one line, a sweep never reports another config's results, a run directory has one driver."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from raysim.errors import ConfigError
from raysim.run import main

SMALL = ["dataset=digits", "model=mclr", "num_clients=4", "local.batch_size=32", "--quiet"]


def cli(args, cwd, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "raysim.run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def one_error_line(r) -> str:
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("raysim [")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# ---------------------------------------------------------------- Ray addresses, Ctrl-C
@pytest.fixture
def not_ray():
    """A TCP listener that accepts and answers like a web server: the dashboard's port, a tunnel."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            try:
                conn.settimeout(1)
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    srv.close()


def test_an_open_port_that_is_not_ray_is_one_line_within_seconds(tmp_path, not_ray):
    t0 = time.time()
    r = cli([*SMALL, f"ray.address={not_ray}", f"output_dir={tmp_path / 'runs'}"], tmp_path, timeout=60)
    line = one_error_line(r)
    assert r.returncode == 2 and f"{not_ray} answers but is not a Ray head node's GCS" in line, line
    assert time.time() - t0 < 20 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("address", ["garbage", "10.0.0.1", "host:99999", "ray//x:1"])
def test_an_address_of_no_form_ray_takes_is_one_line_naming_the_forms(tmp_path, address):
    r = cli([*SMALL, f"ray.address={address}"], tmp_path, timeout=60)
    line = one_error_line(r)
    assert r.returncode == 2 and f"ray.address={address!r} is not an address Ray can join" in line
    assert "HOST:PORT" in line and "ray://HOST:PORT" in line


def test_an_address_nothing_answers_is_one_line_without_ray_warnings(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    r = cli([*SMALL, f"ray.address=127.0.0.1:{port}"], tmp_path, timeout=60)
    assert r.returncode == 2 and "nothing answers at 127.0.0.1" in one_error_line(r)
    assert time.time() - t0 < 20 and "rpc_client" not in r.stderr and "gcs_client" not in r.stderr


def test_an_unroutable_address_is_one_line_within_the_check(tmp_path):
    """10.255.255.1 routes nowhere (or, behind a proxy, to something that is not Ray): either
    way one line within the 5 s check, no Ray C++ warnings."""
    t0 = time.time()
    r = cli([*SMALL, "ray.address=10.255.255.1:6379"], tmp_path, timeout=60)
    line = one_error_line(r)
    assert r.returncode == 2 and "ray.address='10.255.255.1:6379'" in line, line
    assert time.time() - t0 < 20 and "rpc_client" not in r.stderr and "gcs_client" not in r.stderr


def test_ctrl_c_inside_ray_init_ends_the_command_at_once(tmp_path):
    """SIGINT while the command is starting its local Ray (inside ray.init, whose C++ code
    runs no Python signal handler): exit 130 within seconds, one line, nothing written,
    no Ray process of it left."""
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *SMALL[:-1], "rounds=50", "resources.ray_start_s=0",
                          f"output_dir={tmp_path / 'runs'}"], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=tmp_path)
    seen = ""
    while "starting a local Ray" not in seen:
        line = p.stderr.readline()
        assert line, seen
        seen += line
    time.sleep(1.0)  # ray.init takes several seconds here
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and time.time() - t0 < 10, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_sigterm_before_ray_starts_is_exit_130(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *SMALL[:-1], "rounds=50",
                          f"output_dir={tmp_path / 'runs'}"], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=tmp_path)
    seen = ""
    while "config:" not in seen:  # the checks have run; Ray is about to start
        seen += p.stderr.readline()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err


# ---------------------------------------------------------------- files and names
def test_bad_files_and_plugins_are_one_line(tmp_path):
    (tmp_path / "junk.yaml").write_bytes(bytes(range(256)) * 8)
    r = cli([*SMALL, "--config", "junk.yaml"], tmp_path, timeout=60)
    assert r.returncode == 2 and "junk.yaml is not UTF-8 text" in one_error_line(r)

    (tmp_path / "raising_plugin.py").write_text("x = 1\nraise ValueError('the plugin broke')\n")
    (tmp_path / "broken_plugin.py").write_text("def f(:\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = cli([*SMALL, "plugins=[raising_plugin]"], tmp_path, env=env, timeout=60)
    line = one_error_line(r)
    assert r.returncode == 2 and "ValueError: the plugin broke" in line and "raising_plugin.py:2" in line, line
    r = cli([*SMALL, "plugins=[broken_plugin]"], tmp_path, env=env, timeout=60)
    line = one_error_line(r)
    assert r.returncode == 2 and "syntax error" in line and "broken_plugin.py:1" in line, line

    r = cli([*SMALL, f"run_name={'x' * 300}"], tmp_path, timeout=60)
    assert r.returncode == 2 and "run_name must be at most 200 bytes" in one_error_line(r)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")  # 9**9 strings once expanded
    t0 = time.time()
    r = cli([*SMALL, "--config", "bomb.yaml"], tmp_path, timeout=60)
    assert r.returncode == 2 and "bomb.yaml expands to more than" in one_error_line(r)
    assert time.time() - t0 < 15
    (tmp_path / "loop.yaml").write_text("a: &x [1, *x]\n")
    r = cli([*SMALL, "--config", "loop.yaml"], tmp_path, timeout=60)
    assert r.returncode == 2 and "an alias refers to a node that contains it" in one_error_line(r)


def test_an_output_dir_that_cannot_be_written_is_found_before_ray(tmp_path):
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    target = "/proc/raysim-runs" if os.geteuid() == 0 else str(ro / "runs")  # root writes anywhere but /proc
    t0 = time.time()
    r = cli([*SMALL, f"output_dir={target}"], tmp_path, timeout=60)
    line = one_error_line(r)
    assert r.returncode == 2 and "cannot create folders in" in line, line
    assert "starting a local Ray" not in r.stderr and time.time() - t0 < 15


def test_a_label_file_shorter_than_its_image_file_names_both(tmp_path):
    from test_datasets import write_idx

    from raysim.config import load_config
    from raysim.data.datasets import load_dataset

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (50, 28, 28)))
    write_idx(raw / "train-labels-idx1-ubyte", rng.integers(0, 10, 40))
    write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28)))
    write_idx(raw / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 20))
    cfg = load_config(overrides=["dataset=mnist", f"data_dir={tmp_path}", "download=false"])
    with pytest.raises(ConfigError) as e:
        load_dataset(cfg)
    msg = str(e.value)
    assert "train-images-idx3-ubyte holds 50 samples" in msg and "train-labels-idx1-ubyte holds 40 labels" in msg


def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint(tmp_path):
    """The checkpoint's temporary file on a device that is always full (/dev/full): one
    line naming the file and the last good round; the temporary file is gone, the last
    checkpoint untouched."""
    import torch

    from raysim.errors import WriteFailed
    from raysim import checkpoint

    checkpoint.save(tmp_path, {"round": 4, "w": torch.ones(3)})
    before = (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(WriteFailed) as e:
        checkpoint.save(tmp_path, {"round": 6, "w": torch.zeros(1000)}, last_good=4)
    assert str(e.value) == (f"no space left on device writing {tmp_path / 'checkpoint.pt'}; the last good "
                            "checkpoint is round 4 (resume=... continues from it)")
    assert not os.path.lexists(tmp_path / "checkpoint.pt.tmp")
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


# ---------------------------------------------------------------- run directories
def test_a_non_ascii_run_name_runs_resumes_and_finishes_once(ray_local, tmp_path, capfd):
    """run_name=é: Ray's metric tags are escaped, the run finishes and resumes; a resume of
    the finished run says so and rewrites nothing; a run directory another live process
    holds is refused; a stale lock (its process gone) is taken over."""
    from raysim.run_lock import FILE, RunLock

    out = tmp_path / "runs"
    assert main([*SMALL, "rounds=2", "run_name=été-ü", f"output_dir={out}"]) == 0
    run = out / "été-ü"
    assert json.loads((run / "summary.json").read_text())["rounds"] == 2
    capfd.readouterr()
    files = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    assert main([f"resume={run}"]) == 0
    err = capfd.readouterr().err
    assert err == f"run {run} already finished (2 rounds); nothing to do (rounds=N with N > 2 runs more rounds)\n"
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == files

    with RunLock(run):  # a live process (this one) drives the run: a second command is refused
        r = cli([f"resume={run}", "rounds=3", "--quiet"], tmp_path, timeout=60)
        assert r.returncode == 2 and f"{run} is in use: process {os.getpid()}" in one_error_line(r)
    assert not (run / FILE).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / FILE).write_text(f"{socket.gethostname()} {dead.pid} 1.0\n")  # a lock left by a killed process
    assert main([f"resume={run}", "rounds=3"]) == 0
    assert json.loads((run / "summary.json").read_text())["rounds"] == 3 and not (run / FILE).exists()


def test_a_second_simulate_names_the_plugin_it_runs_and_a_reimported_plugin_replaces(ray_local, tmp_path):
    import importlib

    import raysim
    import stateful_plugin

    a = raysim.simulate(algorithm="test_state_counter", plugins=["stateful_plugin"], rounds=1, num_clients=4,
                        output_dir=str(tmp_path), run_name="a", progress=False)
    importlib.reload(stateful_plugin)  # the same module registering its parts again: no 'registered twice'
    b = raysim.simulate(algorithm="test_state_counter", rounds=1, num_clients=4, output_dir=str(tmp_path),
                        run_name="b", progress=False)  # no plugins given: the run still names its code
    assert list(a.config.plugins) == ["stateful_plugin"] == list(b.config.plugins)


# ---------------------------------------------------------------- sweeps
SWEEP = ["seed=0,1", "algorithm=fedavg", "model=mclr", "rounds=1", "num_clients=4"]


def test_a_sweep_never_reports_another_configs_results(ray_local, tmp_path, capsys, monkeypatch):
    """A finished sweep rerun with other fixed values into the same folder is refused by
    key, before anything runs; output_dir= is honoured and run_name= refused with the flag to
    use. The finished points are made as a sweep's trials make them (`sweep.run_point`), in
    this session's Ray (a whole sweep under Ray Tune runs in test_workflow.py)."""
    from raysim.sweep import main as sweep
    from raysim.sweep import parse, plan, run_point

    monkeypatch.chdir(tmp_path)  # run_point changes directory, as a trial does; put it back after
    _, files, fixed, grid = parse(SWEEP, None)
    for point in plan(files, fixed, grid, tmp_path / "out" / "s"):
        run_point(point, files, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "out" / "s").iterdir() if (p / "summary.json").exists()) == \
        ["seed=0", "seed=1"]
    for changed, says in ((["local.lr=0.5"], "local.lr was 0.05, is 0.5"), (["rounds=2"], "rounds was 1, is 2"),
                          (["algorithm=fedprox"], "algorithm was 'fedavg', is 'fedprox'")):
        args = [a for a in SWEEP if a.split("=")[0] not in {c.split("=")[0] for c in changed}] + changed
        assert sweep([*args, f"output_dir={tmp_path / 'out'}", "--name", "s"]) == 2
        err = capsys.readouterr().err
        assert "holds a finished run of another config" in err and says in err, err
    assert sweep([*SWEEP, "run_name=x", "--output-dir", str(tmp_path)]) == 2


def test_a_point_the_server_refuses_is_reported_in_one_line(ray_local, tmp_path, monkeypatch):
    """A trial reports a point whose data the server refuses (400 clients on digits' 1,437
    training images) as `raysim_error`, one line, instead of raising into Tune (which prints
    its traceback); `sweep` says it as `point X failed: ...`. A good point reports its summary."""
    from raysim.sweep import parse, plan, point_result

    monkeypatch.chdir(tmp_path)
    _, files, fixed, grid = parse(["num_clients=6,400", "algorithm=fedavg", "model=mclr", "rounds=1"], None)
    good, bad = plan(files, fixed, grid, tmp_path / "s")
    said = point_result(bad, files, str(tmp_path))
    assert list(said) == ["raysim_error"] and "\n" not in said["raysim_error"], said
    assert said["raysim_error"].startswith("ConfigError: partition 'dirichlet'") and "1437 training samples" in said["raysim_error"]
    assert not (tmp_path / "s" / "num_clients=400").exists()
    assert 0 <= point_result(good, files, str(tmp_path))["final_accuracy"] <= 1


@pytest.mark.parametrize("text, says", [
    ("grid: [1, 2]\n", "grid must be a mapping {key: [values]}, got [1, 2]"),
    ("name: [1]\ngrid: {seed: [0, 1]}\n", "name must be a folder name"),
    ("fixed: [rounds=1]\ngrid: {seed: [0, 1]}\n", "fixed must be a mapping {key: value}"),
    ("config: 7\ngrid: {seed: [0, 1]}\n", "config must be a config file or a list of them"),
    ("config: nope.yaml\ngrid: {seed: [0, 1]}\n", "config file 'nope.yaml' not found"),  # one file, not 'n', 'o', ...
])
def test_a_sweep_file_of_the_wrong_shape_is_one_line(tmp_path, text, says, capsys):
    from raysim.sweep import main as sweep

    (tmp_path / "s.yaml").write_text(text)
    assert sweep(["--file", str(tmp_path / "s.yaml"), "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("*/")), "nothing is written"


def test_the_python_api_takes_one_config_file_as_a_string_and_refuses_odd_overrides(tmp_path):
    import raysim

    with pytest.raises(ConfigError, match="config file 'nope.yaml' not found"):  # not the files 'n', 'o', ...
        raysim.simulate(config="nope.yaml", progress=False)
    with pytest.raises(ConfigError, match="overrides must be a mapping"):
        raysim.simulate(overrides=5, progress=False)
    for bad in (123, [Path("a.yaml"), 7], {"a.yaml": 1}):  # a config= that names no files is one ConfigError
        with pytest.raises(ConfigError, match="config= takes a config file's path"):
            raysim.simulate(config=bad, progress=False)
    with pytest.raises(ConfigError, match=r"'rounds' in the overrides \(key=value on the command line, keywords"):
        raysim.simulate(rounds="x", progress=False)  # an API caller is not told of a command line alone


def test_a_second_sweep_into_a_folder_a_running_sweep_holds_is_refused(tmp_path, capsys):
    """Two sweeps into one folder would run, and restart (removing), the same points: the
    running one holds the folder's lock, and the second is one line naming its process."""
    from raysim.sweep import main as sweep

    (tmp_path / "s").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from raysim.run_lock import RunLock; "
                               f"RunLock({str(tmp_path / 's')!r}).__enter__(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert sweep([*SWEEP, "--output-dir", str(tmp_path), "--name", "s"]) == 2
        err = capsys.readouterr().err
        assert f"is in use: process {holder.pid}" in err and len(err.strip().splitlines()) == 1, err
        assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [".lock"]
    finally:
        holder.kill()


def test_yaml_11_words_stay_text_for_text_keys_and_convert_for_bool_keys():
    """run_name=off named a run 'False' (YAML 1.1 reads off / no / yes / on as booleans)."""
    from raysim.config import load_config

    cfg = load_config(overrides=["run_name=off", "log.tensorboard=on", "download=no"])
    assert cfg.run_name == "off" and cfg.log.tensorboard is True and cfg.download is False
    with pytest.raises(ConfigError, match="'yes'"):  # an unknown partition by its name, not a bool
        load_config(overrides=["partition=yes"])


def test_a_tracker_whose_package_is_missing_is_one_line(monkeypatch):
    import importlib.util

    from raysim.config import load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb=true needs the wandb package: pip install 'raysim\[wandb\]'"):
        load_config(overrides=["log.wandb=true"])
    with pytest.raises(ConfigError, match="log.wandb_mode must be online, offline or disabled"):
        load_config(overrides=["log.wandb_mode=sometimes"])
