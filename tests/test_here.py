"""Clients trained in the command's own process, without Ray (runtime/here.py, issue 58): a
small command on its own machine starts no Ray, and its models are those of the same run on
client actors, bit for bit, resumed or not; a command whose training would pay for Ray's
start starts it after the data; a config that needs client actors gets them."""
import json
import os
import signal
import subprocess
import sys
import time

import own_ray
import pytest
import torch

from raysim.config import load_config
from raysim.runtime import here

COMMON = ["algorithm=scaffold", "dataset=digits", "model=mlp", "num_clients=8", "participation=0.5",
          "local.epochs=1", "checkpoint_every=2", "--quiet"]


def _run(tmp_path, *args, env=None):
    given = list(args) if args[0].startswith("resume=") else [*COMMON, f"output_dir={tmp_path}", *args]
    r = subprocess.run([sys.executable, "-m", "raysim.run", *given, "--quiet"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_a_small_command_trains_here_without_ray_and_its_models_are_the_actors(tmp_path, ray_tmp):
    env = dict(os.environ, RAY_TMPDIR=ray_tmp)
    _run(tmp_path, "rounds=2", "run_name=here", env=env)
    _run(tmp_path, f"resume={tmp_path / 'here'}", "rounds=4", env=env)  # resumed here too
    log = (tmp_path / "here" / "log.txt").read_text()
    assert "no Ray: the clients' training would take this process" in log
    summary = json.loads((tmp_path / "here" / "summary.json").read_text())
    assert summary["client_actor_nodes"] == {"this process": 1}
    assert not own_ray.under(ray_tmp) and not os.listdir(ray_tmp)  # no Ray was started (nor left behind)
    # the same run on two client actors (resources.num_actors asks for them)
    _run(tmp_path, "rounds=4", "resources.num_actors=2", "run_name=actors")
    assert "no Ray" not in (tmp_path / "actors" / "log.txt").read_text()
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("here", "actors"))
    for part in a:
        if isinstance(a[part], dict):
            assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    # training that would pay for Ray's start (a start costing ~nothing here): Ray starts after the data
    r = subprocess.run([sys.executable, "-m", "raysim.run", *COMMON, f"output_dir={tmp_path}", "rounds=4",
                        "resources.ray_start_s=0.000001", "run_name=later"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    c = torch.load(tmp_path / "later" / "model.pt", weights_only=True)
    assert all(torch.equal(a["global"][k], c["global"][k]) for k in a["global"])
    assert "no Ray" not in (tmp_path / "later" / "log.txt").read_text()
    assert os.listdir(ray_tmp)  # it did start a Ray, under RAY_TMPDIR
    assert not own_ray.under(ray_tmp)  # and stopped it


@pytest.mark.slow
def test_ctrl_c_while_the_clients_train_here_keeps_the_rounds_and_resume_ends_the_run(tmp_path):
    """SIGINT mid-run, the clients training in the command's process: exit 130 with the
    resume hint, the rounds kept; `resume=` (here too) finishes it with the numbers of a run
    never stopped (a stateful algorithm, its states in the checkpoint)."""
    run = tmp_path / "runs" / "r"
    args = ["dataset=digits", "model=mlp", "num_clients=4", "participation=1.0", "plugins=[stateful_plugin]",
            "algorithm=test_slow_state_counter", "checkpoint_every=1", "resources.ray_start_s=1000",  # here, however long
            f"output_dir={tmp_path / 'runs'}"]
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *args, "run_name=r", "rounds=100"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 150
    while not (run / "checkpoint.pt").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and f"resume={run}" in err and "Traceback" not in err, err[-2000:]
    assert "no Ray" in (run / "log.txt").read_text()
    _run(tmp_path, f"resume={run}", "rounds=6", "plugins=[stateful_plugin]")
    r = subprocess.run([sys.executable, "-m", "raysim.run", *args, "rounds=6", "run_name=whole", "--quiet"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (torch.load(tmp_path / "runs" / n / "model.pt", weights_only=True) for n in ("r", "whole"))
    assert all(torch.equal(a["global"][k], b["global"][k]) for k in a["global"])


def test_a_run_with_no_ray_imports_none(tmp_path):
    """raysim.lazy_ray: importing Ray costs ~0.6 s, which a command training here never needs."""
    code = ("import sys; from raysim.run import main; "
            f"code = main(['dataset=digits', 'model=mclr', 'num_clients=4', 'rounds=1', 'output_dir={tmp_path}', "
            "'--quiet']); print(code, 'ray' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.stdout.split()[-2:] == ["0", "False"], r.stderr[-2000:]


def test_two_runs_in_one_process_each_with_its_own_local_ray_use_their_own_actors(tmp_path):
    """The CLI's `main` stops the Ray it started; a second call in the same process (as
    `results.table --verify` makes) starts another, and must not take the first one's client
    actors, which the first run left for reuse (runtime/pool.py)."""
    code = ("from raysim.run import main; "
            "print([main(['dataset=digits', 'model=mclr', 'num_clients=4', 'rounds=1', 'resources.num_actors=1', "
            f"'output_dir={tmp_path}', f'run_name=r{{i}}', '--quiet']) for i in range(2)])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.stdout.strip().splitlines()[-1] == "[0, 0]", r.stderr[-3000:]
    assert (tmp_path / "r1" / "summary.json").is_file()


def test_what_needs_client_actors_gets_them():
    assert here.cannot(load_config(), stored=False) is None
    for keys, why in ((["resources.num_actors=2"], "resources.num_actors"),
                      (["faults.kill_fraction=0.5", "faults.kill_rounds=[2]"], "faults"),
                      (["ray.dashboard=true"], "ray.dashboard"),
                      (["algorithm=fedbuff"], "in flight"),
                      (["data_store=files"], "files")):
        assert why in here.cannot(load_config(overrides=keys), stored=False), keys
    assert "files" in here.cannot(load_config(), stored=True)


def test_ray_is_worth_its_start_when_the_training_would_take_longer_here(monkeypatch):
    cfg = load_config(overrides=["resources.ray_start_s=8"])
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert here.worth_ray(15.9, cfg)[0] is False and here.worth_ray(16.1, cfg)[0] is True  # 8 x 2/1
    monkeypatch.setattr(os, "cpu_count", lambda: 9)
    assert here.worth_ray(8.9, cfg)[0] is False and here.worth_ray(9.1, cfg)[0] is True  # 8 x 9/8
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert here.worth_ray(1e9, cfg)[0] is False  # one CPU: actors train no faster than this process


def test_the_runner_here_gives_copies_and_leaves_torchs_generator_and_threads_as_they_were():
    class Runner:
        def run(self, data, payload):
            torch.manual_seed(123)
            torch.set_num_threads(1)
            payload["w"].add_(1)  # the caller's copy must not see it
            return {"w": payload["w"]}, [payload["w"]]

    actor = here.HereActor.__new__(here.HereActor)
    actor.runner = Runner()
    w = torch.zeros(3)
    torch.manual_seed(7)
    expected = torch.rand(2)
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    first, second = actor.run.options(num_returns=2).remote(None, {"w": w})
    got = here.get(first)
    assert torch.equal(got["w"], torch.ones(3)) and torch.equal(w, torch.zeros(3))
    assert here.get(second)[0] is not got["w"]  # each result its own copy, as from the object store
    assert torch.equal(torch.rand(2), expected) and torch.get_num_threads() == threads
