"""The warm local service (raysim/service.py): `raysim.up`, commands that use it, `raysim.down`.

One service for the module (starting it costs a Ray start and a torch import); every command
runs as its own process, as a user's would."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

SMALL = ["model=mclr", "rounds=2", "num_clients=6", "participation=0.5"]


def command(args, cwd, env, timeout=240):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def service_processes(folder: Path) -> list:
    """Every process of the service's Ray: those naming its folder and their children."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(folder / "ray") in a for a in p.info["cmdline"] or []):
                for q in [p, *p.children(recursive=True)]:
                    found[q.pid] = q
        except psutil.Error:
            pass
    return list(found.values())


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    folder = Path(tempfile.mkdtemp(prefix="rs-"))  # short: Ray's socket paths live under it
    work = tmp_path_factory.mktemp("service")
    (work / "edited_plugin.py").write_text("VERSION = 1\n")
    env = dict(os.environ, RAYSIM_SERVICE_DIR=str(folder),
               PYTHONPATH=os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]))
    r = command(["raysim.up", "--num-cpus", "4", "--dashboard"], work, env)
    assert r.returncode == 0 and "the raysim service is up at 127.0.0.1:" in r.stdout, r.stdout + r.stderr
    _the_dashboard_is_behind_the_token_the_line_names(r.stdout, folder)
    yield folder, work, env
    command(["raysim.down"], work, env)
    shutil.rmtree(folder, ignore_errors=True)


def _the_dashboard_is_behind_the_token_the_line_names(out: str, folder: Path) -> None:
    """raysim.up --dashboard prints the Dashboard's address and the service's token file; the
    Dashboard's API answers 401 without that token and 200 with it."""
    import re
    import urllib.error
    import urllib.request

    line = next(line for line in out.splitlines() if "Ray's dashboard:" in line)
    url = re.search(r"(http://\S+)", line).group(1)
    token_file = re.search(r"paste the contents of (\S+)", line).group(1)
    assert Path(token_file) == folder / "token", line
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/api/v0/actors", timeout=10)
    assert e.value.code == 401
    token = Path(token_file).read_text().strip()
    req = urllib.request.Request(url + "/api/v0/actors", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def test_a_command_on_the_service_gives_the_cold_commands_model(service):
    folder, work, env = service
    cold_env = dict(env, RAYSIM_SERVICE_DIR=str(work / "no-service"))
    r = command(["raysim.run", *SMALL, "run_name=cold", "--quiet"], work, cold_env)
    assert r.returncode == 0 and "raysim service" not in r.stderr, r.stderr
    for name in ("warm1", "warm2"):  # the second on the processes the first left
        r = command(["raysim.run", *SMALL, f"run_name={name}"], work, env)
        assert r.returncode == 0 and "using the raysim service at 127.0.0.1:" in r.stderr, r.stderr
        assert "starting a local Ray" not in r.stderr
    assert "the service's warm server runs it" in r.stderr
    cold, warm1, warm2 = (torch.load(work / "runs" / n / "model.pt", weights_only=True) for n in ("cold", "warm1", "warm2"))
    for k, v in cold["global"].items():
        assert torch.equal(v, warm1["global"][k]) and torch.equal(v, warm2["global"][k]), k
    r = command(["raysim.run", *SMALL, "algorithm=nope"], work, env)  # checked in the service's server
    errors = [line for line in r.stderr.splitlines() if not line.startswith("raysim [")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0].startswith("error: algorithm='nope' is not a known algorithm; choose one of:"), r.stderr


def test_an_edited_plugin_is_noticed(service):
    folder, work, env = service
    r = command(["raysim.run", *SMALL, "plugins=[edited_plugin]", "run_name=p1"], work, env)
    assert r.returncode == 0, r.stderr
    r = command(["raysim.run", *SMALL, "plugins=[edited_plugin]", "run_name=p2"], work, env)
    assert r.returncode == 0 and "code changed" not in r.stderr, r.stderr
    (work / "edited_plugin.py").write_text("VERSION = 22\n")
    r = command(["raysim.run", *SMALL, "plugins=[edited_plugin]", "run_name=p3"], work, env)
    assert r.returncode == 0 and "raysim's code changed on disk since the service's server started" in r.stderr, \
        r.stderr


def test_ctrl_c_stops_that_run_only(service):
    folder, work, env = service
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", "model=mclr", "rounds=100000", "num_clients=6",
                          "eval_every=1000", "run_name=long"], cwd=work, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:  # until the rounds start
        lines.append(line)
        if "run directory:" in line:
            break
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    err = "".join(lines) + p.stderr.read()
    assert p.wait(timeout=60) == 130 and "interrupted" in err, err
    r = command(["raysim.run", *SMALL, "run_name=after"], work, env)  # the service still serves
    assert r.returncode == 0 and "using the raysim service" in r.stderr, r.stderr


def test_up_twice_is_said_and_down_leaves_no_process(service):
    folder, work, env = service
    r = command(["raysim.up"], work, env)
    assert r.returncode == 0 and "already up" in r.stdout
    before = service_processes(folder)
    assert len(before) >= 3  # GCS, raylet and the workers at least
    r = command(["raysim.down"], work, env)
    assert r.returncode == 0 and "the raysim service is down" in r.stdout
    gone, alive = psutil.wait_procs(before, timeout=15)
    assert not alive and not service_processes(folder) and not (folder / "address").exists()
