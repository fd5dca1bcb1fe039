"""A real 2-node Ray cluster on one machine (`ray start --head` + `ray start --address`,
each node with its own resources): client actors land on both nodes, results equal a
one-node run, and the platform's metrics are read back from Ray's metrics endpoints."""
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import pytest
import torch

from raysim.run import main

RUN = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "rounds=8", "local.epochs=1",
       "local.batch_size=16", "resources.clients_per_actor=3", "plugins=[stateful_plugin]",
       "algorithm=test_slow_state_counter", "--quiet"]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _kill_marked(marker: str) -> None:
    """Stop every process of this cluster (and only those: `ray stop` would also stop the
    test session's own Ray): they all inherited the marker in their environment."""
    mine, tag = [], f"RAYSIM_TEST_CLUSTER={marker}".encode()
    for p in psutil.process_iter():
        try:  # read /proc directly: psutil's environ() comes back empty for Ray's renamed agents
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if tag in f.read().split(b"\0"):
                    mine.append(p)
        except OSError:
            pass
    for p in mine:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(mine, timeout=20)


@pytest.fixture(scope="module")
def two_nodes():
    """The module's cluster: 2 CPUs and 1 logical GPU (Ray's resource; no device) a node. A run
    that asks for no GPU (the default) is placed as on nodes without one."""
    yield from _two_nodes({}, ["--num-gpus=1"])


@pytest.fixture()
def two_nodes_one_to_lose():
    """A fresh cluster whose worker node's processes have RAYSIM_TEST_LOSE_HOST=1."""
    yield from _two_nodes({"RAYSIM_TEST_LOSE_HOST": "1"})


@pytest.fixture()
def two_nodes_all_actors_on_the_worker():
    """A fresh cluster whose head has no CPU (client actors go to the worker node only) and
    whose worker node's processes have RAYSIM_TEST_LOSE_HOST=1."""
    yield from _two_nodes({"RAYSIM_TEST_LOSE_HOST": "1"}, head_more=["--num-cpus=0"])


def _two_nodes(worker_env: dict, more: list = (), head_more: list = ()):
    marker = secrets.token_hex(8)
    temp = tempfile.mkdtemp(prefix="rs2n", dir="/tmp")  # short: Ray's socket paths live under it
    # Ray's processes wait 5 s for the GCS by default; on 2 cores beside the other test worker
    # it once took longer (CI, stop 94), so they wait a minute here.
    env = dict(os.environ, RAYSIM_TEST_CLUSTER=marker, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_metrics_report_interval_ms="1000", RAY_gcs_rpc_server_connect_timeout_s="60")
    env.pop("RAY_ADDRESS", None)
    start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--num-cpus=2", "--disable-usage-stats", *more]
    try:
        for attempt in range(3):  # a port found free may be taken before Ray binds it: fresh ports
            gcs, client, m_head, m_worker, a_head, a_worker = _free_ports(6)
            try:
                subprocess.run([*start, "--head", f"--port={gcs}", "--include-dashboard=false", f"--temp-dir={temp}",
                                f"--ray-client-server-port={client}", '--resources={"head_node": 1}',
                                f"--metrics-export-port={m_head}", f"--dashboard-agent-listen-port={a_head}",
                                *head_more], env=env, check=True, capture_output=True, timeout=120)
                subprocess.run([*start, f"--address=127.0.0.1:{gcs}", '--resources={"worker_node": 1}',
                                f"--metrics-export-port={m_worker}", f"--dashboard-agent-listen-port={a_worker}"],
                               env={**env, **worker_env}, check=True, capture_output=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                _kill_marked(marker)
                if attempt == 2:
                    raise
        yield {"address": f"127.0.0.1:{gcs}", "env": env, "metrics_ports": [m_head, m_worker]}
    finally:
        _kill_marked(marker)
        shutil.rmtree(temp, ignore_errors=True)


def _scrape(ports: list[int]) -> str:
    text = []
    for port in ports:
        try:
            text.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        except OSError:
            pass
    return "\n".join(text)


def _value(text: str, name: str, run: str) -> float | None:
    """The largest sample of metric `name` for this run across the scraped endpoints."""
    values = [float(m.group(1)) for m in re.finditer(rf'^{name}{{[^}}]*run="{run}"[^}}]*}} (\S+)$', text, re.M)]
    return max(values) if values else None


@pytest.mark.slow
def test_two_node_run_spreads_actors_matches_one_node_and_exports_metrics(ray_local, two_nodes, tmp_path):
    cmd = [sys.executable, "-m", "raysim.run", *RUN, f"ray.address={two_nodes['address']}",
           f"output_dir={tmp_path}", "run_name=cluster"]
    p = subprocess.Popen(cmd, env=two_nodes["env"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    seen: dict = {}
    while p.poll() is None:  # read Ray's metrics endpoints while the run goes on
        text = _scrape(two_nodes["metrics_ports"])
        for name in ("ray_raysim_rounds_done_total", "ray_raysim_client_updates_total", "ray_raysim_bytes_up_total",
                     "ray_raysim_accuracy", "ray_raysim_round_seconds"):
            v = _value(text, name, "cluster")
            if v is not None:
                seen.setdefault(name, []).append(v)
        time.sleep(0.5)
    out, err = p.communicate()
    assert p.returncode == 0, err[-3000:]

    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert len(summary["client_actor_nodes"]) == 2, summary["client_actor_nodes"]  # actors on both nodes
    assert sum(summary["client_actor_nodes"].values()) == 4

    # metrics came from Ray while the run was going on, and moved
    rounds = seen.get("ray_raysim_rounds_done_total", [])
    assert rounds and max(rounds) >= 3 and rounds == sorted(rounds), seen
    assert max(seen["ray_raysim_client_updates_total"]) == 6 * max(rounds)  # 6 clients a round, none dropped
    assert max(seen["ray_raysim_bytes_up_total"]) > 0
    assert all(0 <= a <= 1 for a in seen["ray_raysim_accuracy"])

    # the same run on one node (the test session's Ray, another number of actors)
    assert main([*RUN, "resources.clients_per_actor=12", f"output_dir={tmp_path}", "run_name=one"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("cluster", "one"))
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_both_nodes_read_the_training_data_from_files_a_folder_both_reach(ray_local, two_nodes, tmp_path):
    """data_store=files on a cluster: `data_store_dir` is a folder every node reads (here the
    machine's disk, which both nodes share); the actors on both nodes read their clients'
    rows from the files, and the model is the one-node object-store run's, bit for bit."""
    run = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "rounds=3", "local.batch_size=16",
           "resources.clients_per_actor=3", f"output_dir={tmp_path}", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "raysim.run", *run, f"ray.address={two_nodes['address']}",
                        "data_store=files", f"data_store_dir={tmp_path / 'arrays'}", "run_name=files"],
                       env=two_nodes["env"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "files" / "summary.json").read_text())
    assert len(summary["client_actor_nodes"]) == 2, summary["client_actor_nodes"]
    assert summary["client_updates"] == 3 * 6  # every client trained on rows it read, on either node
    assert "GB in files under" in (tmp_path / "files" / "log.txt").read_text()
    assert main([*run, "data_store=memory", "run_name=memory"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("files", "memory"))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_actors_a_cluster_cannot_place_stop_the_run_after_the_placement_timeout(two_nodes, tmp_path):
    """A joined cluster may autoscale, so raysim waits for placement, but boundedly: 3-CPU
    actors on 2-CPU nodes end with one line once resources.placement_timeout passes, and
    nothing is written."""
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "raysim.run", "dataset=digits", "num_clients=4", "rounds=1", "--quiet",
                        f"ray.address={two_nodes['address']}", "resources.num_cpus_per_actor=3",
                        "resources.placement_timeout=4", f"output_dir={tmp_path / 'runs'}"],
                       env=two_nodes["env"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "1 of 1 client actors (3 CPU each) were not placed within " \
        "resources.placement_timeout=4 s" in lines[0], r.stderr
    assert time.time() - t0 < 120  # bounded, not Ray's forever
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_host_lost_mid_round_changes_no_result(ray_local, two_nodes_one_to_lose, tmp_path):
    """Four actors, two on each node; in round 2 the worker node's raylet is killed from
    inside a client's training (tests/support: `test_loses_its_host_counting`, whose clients
    count their rounds in their state), and every actor there dies with it. Their calls are
    made again on the head's actors within round 2 (`redone`, nothing dropped), with the
    states written on the lost node in round 1 (the server holds them); the lost actors,
    which no node has room to restart, are not waited for, and the model is the one-node
    run's without any loss, bit for bit."""
    cluster = two_nodes_one_to_lose
    run = ["dataset=digits", "model=mlp", "num_clients=12", "participation=1.0", "rounds=4", "local.epochs=1",
           "local.batch_size=16", "resources.num_actors=4", "resources.num_cpus_per_actor=1",
           "plugins=[stateful_plugin]", "algorithm=test_loses_its_host_counting", f"output_dir={tmp_path}",
           "--quiet"]
    r = subprocess.run([sys.executable, "-m", "raysim.run", *run, f"ray.address={cluster['address']}",
                        "run_name=lost"], env=cluster["env"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = tmp_path / "lost"
    rows = [c for c in __import__("pyarrow.parquet").parquet.read_table(d / "clients.parquet").to_pylist()
            if c["method"] == "client_update"]
    assert not [c for c in rows if c["status"] != "ok"]
    # each client's state (rounds taken part in) outlived the host that wrote it in round 1
    assert all(c["loss"] == c["round"] for c in rows), [(c["round"], c["cid"], c["loss"]) for c in rows]
    redone = sorted(c["cid"] for c in rows if c["redone"])
    assert redone and len(redone) == 6 and {c["round"] for c in rows if c["redone"]} == {2}, redone  # 2 actors x 3
    log = (d / "log.txt").read_text()
    assert re.search(r"round 2: client actors? .*lost the call of clients \[.*\]; redone on actor \d", log), log
    summary = json.loads((d / "summary.json").read_text())
    assert len(summary["client_actor_nodes"]) == 1, summary  # the live actors, all on the head now
    assert main([*run, "resources.num_actors=1", "run_name=one"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("lost", "one"))
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_logical_gpus_place_four_quarter_gpu_actors_on_each_host(ray_local, two_nodes, tmp_path):
    """Hosts started with --num-gpus=1 (logical: this machine has no GPU) and actors of a
    quarter GPU each: 8 actors, 4 on each host, which summary.json records; the actors see
    no CUDA device, so they train on the CPU (`client_devices`), and the model is the
    one-node run's. `num_gpus_per_actor=auto` starts its probe, which measures nothing
    without CUDA: one actor per GPU, 1 on each host, the same model. What only a real GPU
    cluster shows: docs/cluster.md."""
    cluster = two_nodes
    run = ["dataset=digits", "model=mclr", "num_clients=16", "participation=0.5", "rounds=2", "local.epochs=1",
           "resources.num_gpus_per_actor=0.25", "resources.num_cpus_per_actor=0.25", f"output_dir={tmp_path}", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "raysim.run", *run, f"ray.address={cluster['address']}", "run_name=gpus"],
                       env=cluster["env"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "gpus" / "summary.json").read_text())
    assert sorted(summary["client_actor_nodes"].values()) == [4, 4], summary["client_actor_nodes"]
    assert summary["client_devices"] == ["cpu"]
    assert "8 client actors (0.25 CPU + 0.25 GPU each)" in (tmp_path / "gpus" / "log.txt").read_text()
    # num_gpus_per_actor=auto: the probe (a whole GPU) sees no CUDA device, so one actor per GPU: 2
    auto = [a.replace("=0.25", "=auto") if a.startswith("resources.num_gpus") else a for a in run]
    r = subprocess.run([sys.executable, "-m", "raysim.run", *auto, f"ray.address={cluster['address']}", "run_name=auto"],
                       env=cluster["env"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "auto" / "log.txt").read_text()
    assert "1 client actor, resources.num_gpus_per_actor=auto's probe" in log and "no CUDA device" in log
    assert "2 client actors (0.25 CPU + 1 GPU each) replace the probe" in log
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["gpu_packing"]["actors"] == 2 and sorted(summary["client_actor_nodes"].values()) == [1, 1]
    one = [a for a in run if not a.startswith("resources.")]
    assert main([*one, "resources.num_actors=2", "run_name=one"]) == 0
    for name in ("gpus", "auto"):
        a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in (name, "one"))
        assert all(torch.equal(a[k], b[k]) for k in b), name


@pytest.mark.slow
def test_a_run_that_loses_every_actor_stops_with_one_line_and_a_checkpoint(two_nodes_all_actors_on_the_worker,
                                                                           tmp_path):
    """Every client actor is on the worker node, which is lost in round 2, and no node has
    room to restart them: after resources.lost_actor_wait the run stops, exit 3, with one
    line that names the checkpoint `resume=` goes on from (round 1's)."""
    cluster = two_nodes_all_actors_on_the_worker
    run = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "rounds=4", "local.epochs=1",
           "resources.num_actors=2", "resources.num_cpus_per_actor=1", "resources.lost_actor_wait=5",
           "checkpoint_every=1", "plugins=[stateful_plugin]", "algorithm=test_loses_its_host", f"output_dir={tmp_path}", "--quiet",
           f"ray.address={cluster['address']}", "run_name=gone"]
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "raysim.run", *run], env=cluster["env"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 3, (r.stdout + r.stderr)[-3000:]
    assert time.time() - t0 < 120  # the wait was the configured one, not the default 120 s
    errors = [line for line in r.stderr.splitlines() if "every client actor was lost" in line]
    assert len(errors) == 1 and "resources.lost_actor_wait=5 s" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    resume = re.search(r"resume=(\S+)", r.stderr)
    assert resume, r.stderr[-2000:]
    assert "continues from its checkpoint of round 1" in errors[0], errors[0]
    summary = json.loads((tmp_path / "gone" / "summary.json").read_text())
    assert (summary["status"], summary["actors_lost_round"]) == ("actors_lost", 2), summary
