"""Checkpoints and resume: the CLI process killed mid-run (SIGKILL, taking its own local
Ray with it), then `resume=<run dir>` ends with the same model, metrics and client states
as an uninterrupted run."""
import pytest
import signal
import subprocess
import sys
import time

import psutil
import pyarrow.parquet as pq
import torch

from raysim.config import load_config
from raysim.run import main

RUN = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "rounds=8", "checkpoint_every=2",
       "local.epochs=1", "local.batch_size=16", "plugins=[stateful_plugin]", "algorithm=test_slow_state_counter",
       "--quiet"]


def _kill_tree(proc: psutil.Process) -> list:
    """SIGKILL a process; returns its descendants as they were (its local Ray)."""
    children = proc.children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    return children


def _running(procs: list, timeout: float) -> list:
    """Those of `procs` still running after `timeout` s (a zombie has exited: it only waits
    for a parent that is gone to collect it)."""
    deadline = time.time() + timeout
    while True:
        alive = []
        for q in procs:
            try:
                if q.status() != psutil.STATUS_ZOMBIE:
                    alive.append(q)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.slow
def test_killed_driver_resumes_to_the_same_final_model(ray_local, tmp_path):
    # the run to be killed: its own process with its own local Ray, as a user would start it
    killed = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *RUN, f"output_dir={tmp_path}", "run_name=killed",
                          "ray.num_cpus=2"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None:
        log = killed / "log.txt"
        if log.is_file() and "checkpoint after round 4" in log.read_text():
            break
        time.sleep(0.05)
    assert p.poll() is None, p.stderr.read().decode()[-2000:]
    leftovers = _kill_tree(psutil.Process(p.pid))
    p.wait(timeout=30)
    for q in _running(leftovers, timeout=10):  # Ray's agents may outlive their raylet: clean up
        q.kill()
    assert not (killed / "summary.json").exists()
    ran = [r["round"] for r in pq.read_table(killed / "metrics.parquet").to_pylist()]
    assert ran[-1] < 8  # stopped mid-run

    # resumed (here on the test session's Ray: another cluster, another number of actors)
    assert main(["resume=" + str(killed), "plugins=[stateful_plugin]", "--quiet"]) == 0
    # the same run uninterrupted
    assert main([*RUN, f"output_dir={tmp_path}", "run_name=whole"]) == 0
    whole = tmp_path / "whole"

    a, b = torch.load(killed / "model.pt", weights_only=True), torch.load(whole / "model.pt", weights_only=True)
    assert all(torch.equal(a["global"][k], b["global"][k]) for k in b["global"])
    ma, mb = (pq.read_table(d / "metrics.parquet").to_pylist() for d in (killed, whole))
    assert [r["round"] for r in ma] == list(range(1, 9))  # each round once
    assert [r["accuracy"] for r in ma] == [r["accuracy"] for r in mb]
    assert [r["bytes_up"] for r in ma] == [r["bytes_up"] for r in mb]
    # client states came back from the checkpoint: the per-client round counts go on
    ca, cb = ([(r["round"], r["cid"], r["loss"]) for r in pq.read_table(d / "clients.parquet").to_pylist()]
              for d in (killed, whole))
    assert sorted(ca) == sorted(cb)
    assert max(loss for _, _, loss in ca) >= 3
    log = (killed / "log.txt").read_text()
    assert "resumed after round" in log and "loaded (weights only)" in log


def test_resume_extends_a_finished_run(ray_local, tmp_path):
    common = ["dataset=digits", "model=mlp", "num_clients=10", "rounds=3", "checkpoint_every=5", "--quiet"]
    assert main([*common, f"output_dir={tmp_path}", "run_name=short"]) == 0  # checkpoint after the last round
    assert main([f"resume={tmp_path / 'short'}", "rounds=5", "--quiet"]) == 0
    assert main([*common, "rounds=5", f"output_dir={tmp_path}", "run_name=long"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("short", "long"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert "rounds: 5" in (tmp_path / "short" / "config.yaml").read_text()


def test_fault_injection_kills_actors_and_the_run_ends_with_the_same_model(ray_local, tmp_path):
    """Half the client actors die in round 2: their calls are redone on the others within
    the round, and the model is the one of the run without faults."""
    common = ["dataset=digits", "model=mlp", "num_clients=12", "participation=1.0", "rounds=4",
              "resources.clients_per_actor=3", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "faults.kill_fraction=0.5", "faults.kill_rounds=[2]", "run_name=faults"]) == 0
    assert main([*common, "run_name=clean"]) == 0
    d = tmp_path / "faults"
    rows = pq.read_table(d / "clients.parquet").to_pylist()
    assert not [r for r in rows if r["status"] == "dropped"]
    redone = sorted((r["round"], r["cid"]) for r in rows if r["redone"])
    assert len(redone) == 6 and {rnd for rnd, _ in redone} == {2}  # 2 of 4 actors x 3 clients each
    m = pq.read_table(d / "metrics.parquet").to_pylist()
    assert [r["dropped"] for r in m] == [0, 0, 0, 0]
    assert "fault injection kills client actors" in (d / "log.txt").read_text()
    # the same faults with each client its own piece (resources.wave_mb): the pieces dealt to the killed actors are
    # redone, or, not yet sent, go to live ones
    assert main([*common, "faults.kill_fraction=0.5", "faults.kill_rounds=[2]", "resources.wave_mb=0.0001",
                 "run_name=waves"]) == 0
    assert "go in 12 pieces" in (tmp_path / "waves" / "log.txt").read_text()
    a, b, c = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("faults", "clean", "waves"))
    assert all(torch.equal(a[k], b[k]) and torch.equal(c[k], b[k]) for k in a if torch.is_tensor(a[k]))


def test_stateful_algorithm_with_fedentopt_and_stragglers_resumes_exactly(ray_local, tmp_path):
    """SCAFFOLD's server variate and clients' variates, FedEntOpt's buffer and the
    stragglers' draws all come back: 2 rounds + resume to 4 = 4 rounds straight."""
    common = ["algorithm=scaffold", "selection=fedentopt", "system.stragglers=0.5", "dataset=digits", "model=mlp",
              "num_clients=10", "participation=0.3", "checkpoint_every=2", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "resources.clients_per_actor=10", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    for part in ("global", "c"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in b[part]), part
    ma, mb = (pq.read_table(tmp_path / n / "metrics.parquet").to_pylist() for n in ("part", "whole"))
    assert [r["selected"] for r in ma] == [r["selected"] for r in mb]


def test_a_checkpoint_from_before_a_plugin_option_was_added_still_resumes():
    """Upgrading raysim adds options (fed2.absent came after runs were checkpointed): a key
    the checkpoint's record lacks is no difference while it sits at its default, in the
    core config or in any plugin section; set to something else it is one."""
    from raysim.config import record_diff, run_record

    cfg = load_config(overrides=["algorithm=fedgroup"])
    record = {k: v for k, v in run_record(cfg).items() if k not in ("fed2.absent", "fedgroup.alpha", "eval_every")}
    assert record_diff(record, cfg) == []
    cfg = load_config(overrides=["algorithm=fed2", "fed2.absent=freeze", "local.lr=0.05"])
    record = {k: v for k, v in run_record(cfg).items() if k != "fed2.absent"}
    record["local.lr"] = 0.01
    assert record_diff(record, cfg) == ["fed2.absent", "local.lr"]
