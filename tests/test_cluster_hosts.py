"""`ray up` for real (issue 53): three hosts on this machine (tests/support/hosts.py: network
namespaces on a private bridge, each with its own sshd, home, /tmp and processes), the shipped
cluster-onprem.yaml changed only in its EDIT fields, then the docs' own commands: `ray up`,
`ray exec ... python -m raysim.run ray.address=auto ...`, `ray rsync-down`, `ray down`.

Slow (about eight minutes) and root-only; skipped with the reason elsewhere."""
import ast
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from raysim.run import main

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
from hosts import Hosts, missing  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=f"hosts: {missing()}")]

IDLE_MINUTES = 1
LOSE = ["plugins=[stateful_plugin]", "algorithm=test_loses_its_host"]
RUN = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "rounds=3", "local.epochs=1",
       "local.batch_size=16", "resources.num_actors=3", "--quiet"]


def ray_cli(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def alive_nodes(info: dict) -> list[str]:
    """The addresses of the cluster's live nodes, as Ray on the head sees them."""
    r = ray_cli("exec", info["config"], "python -c 'import ray; ray.init(); "
                "print(\"nodes\", sorted(n[\"NodeManagerAddress\"] for n in ray.nodes() if n[\"Alive\"]))'",
                env=info["env"], timeout=300)
    found = re.search(r"nodes (\[.*\])", r.stdout)
    return ast.literal_eval(found.group(1)) if found else []


def rx_bytes(host) -> int:
    """Bytes this host has received over its link (its eth0's counter)."""
    out = subprocess.run(["ip", "netns", "exec", host.ns, "cat", "/sys/class/net/eth0/statistics/rx_bytes"],
                         capture_output=True, text=True, check=True).stdout
    return int(out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`ray up` of cluster-onprem.yaml on three hosts, with `min_workers: 0` (the workers are
    started when a run needs them) and `idle_timeout_minutes: 1`; `ray down` and the hosts'
    removal after. Each host's sshd gives its sessions PYTHONPATH=~/raysim/tests/support (the
    tests' fault-injecting plugin, imported by client actors on every host) and host 2's
    RAYSIM_TEST_LOSE_HOST=all (that plugin's clients kill host 2 in round 2)."""
    home = tmp_path_factory.mktemp("user-home")  # the user's machine: its ~ holds the cluster's token
    (home / ".raysim").mkdir()
    (home / ".raysim" / "ray_token").write_text(secrets.token_hex(32))
    (home / ".raysim" / "ray_token").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    with Hosts(3) as hosts:
        for i, h in enumerate(hosts.hosts):
            with open(h.folder / "home/.ssh/environment", "a") as f:
                f.write("PYTHONPATH=/root/raysim/tests/support\n" + ("RAYSIM_TEST_LOSE_HOST=all\n" if i == 2 else ""))
        cfg = yaml.safe_load((REPO / "cluster-onprem.yaml").read_text())
        cfg["provider"]["head_ip"] = hosts.hosts[0].address  # the EDIT fields, and nothing else
        cfg["provider"]["worker_ips"] = [h.address for h in hosts.hosts[1:]]
        cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(hosts.key)}
        cfg["min_workers"], cfg["idle_timeout_minutes"] = 0, IDLE_MINUTES
        path = home / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))
        t0 = time.time()
        up = ray_cli("up", "-y", "--no-config-cache", str(path), env=env, timeout=900)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        info = {"hosts": hosts, "config": str(path), "env": env, "home": home, "up_seconds": time.time() - t0}
        try:
            yield info
        finally:
            down = ray_cli("down", "-y", str(path), env=env, timeout=300)
            deadline = time.time() + 30  # a raylet may take a moment to exit after `ray down`
            while True:
                left = {h.name: _ray_processes(h) for h in hosts.hosts}
                stopped = {name: [p for p in procs if "raylet" in p or "gcs_server" in p] for name, procs in left.items()}
                if not any(stopped.values()) or time.time() > deadline:
                    break
                time.sleep(1)
        assert down.returncode == 0, (down.stdout + down.stderr)[-2000:]
        # `ray down` stopped Ray on every host: no raylet, no GCS. (A worker's dashboard and
        # runtime-env agents were seen to outlive it here, reparented to the host's sshd:
        # issue 53's notes; the hosts' removal kills them, so the wait is for these two only.)
        assert not any(stopped.values()), stopped


@pytest.fixture(scope="module")
def one_node(ray_local, tmp_path_factory):
    """The runs of this module on one node (the test session's Ray): their models."""
    where = tmp_path_factory.mktemp("one-node")
    models = {}
    for name, extra in (("fedavg", []), ("lose", LOSE)):
        assert main([*RUN, *extra, "resources.num_actors=1", f"output_dir={where}", f"run_name={name}"]) == 0
        models[name] = torch.load(where / name / "model.pt", weights_only=True)["global"]
    return models


def _ray_processes(host) -> list[str]:
    """The names of Ray's processes still running on `host` (its sshd is not one)."""
    names = []
    for pid in host.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(k in cmd for k in ("raylet", "gcs_server", "ray::", "dashboard", "monitor.py", "log_monitor")):
            program, _, args = cmd.partition(" ")
            names.append(f"{Path(program).name} {args}"[:80])  # the program's name, not its long path
    return names


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def _run_on_head(info: dict, name: str, *extra: str) -> subprocess.CompletedProcess:
    """The run on the cluster, from the head, as docs/cluster.md says; each of its three
    actors takes all a host's CPUs, so they need all three hosts (started if they are not)."""
    return ray_cli("exec", info["config"], f"cd ~/raysim && python -m raysim.run ray.address=auto {' '.join(RUN)} "
                   f"resources.num_cpus_per_actor={os.cpu_count()} {' '.join(extra)} output_dir=runs run_name={name}",
                   env=info["env"], timeout=900)


def _model(info: dict, name: str) -> dict:
    run = info["hosts"].hosts[0].folder / "home" / "raysim" / "runs" / name
    return torch.load(run / "model.pt", weights_only=True)["global"]


def test_a_run_asking_for_more_actors_than_the_head_holds_scales_up_then_the_docs_commands(cluster, one_node,
                                                                                            tmp_path):
    """Only the head is up (`min_workers: 0`); a run asks for three actors of every CPU a
    host has: the autoscaler starts both workers over SSH while the run says it waits; one
    actor on each host; the one-node model, bit for bit; `ray rsync-down` fetches the run,
    which only the head has; `ray dashboard` forwards the Dashboard, whose Actors view lists
    the run's actors on each host."""
    path, env, hosts = cluster["config"], cluster["env"], cluster["hosts"]
    assert alive_nodes(cluster) == [hosts.hosts[0].address]  # the head alone
    t0 = time.time()
    run = _run_on_head(cluster, "cluster")
    seconds = time.time() - t0
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "raysim: waiting for 2 of 3 client actors" in run.stderr + run.stdout, (run.stdout + run.stderr)[-3000:]
    got = ray_cli("rsync-down", path, "~/raysim/runs/cluster/", str(tmp_path / "cluster"), env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert len(summary["client_actor_nodes"]) == 3, summary["client_actor_nodes"]  # one actor on each host
    print(f"ray up {cluster['up_seconds']:.0f} s; a run that scaled 1 -> 3 hosts: {seconds:.0f} s, "
          f"{summary['seconds_to_end_of_round_1']:.1f} s to the end of round 1")
    b = torch.load(tmp_path / "cluster" / "model.pt", weights_only=True)["global"]
    assert _same(one_node["fedavg"], b)
    # each host's run directory is its own: only the head (where the command ran) has it
    assert (hosts.hosts[0].folder / "home" / "raysim" / "runs" / "cluster").is_dir()
    assert not (hosts.hosts[1].folder / "home" / "raysim" / "runs" / "cluster").exists()
    _the_dashboard_lists_the_actors_on_each_host(cluster, "cluster")


def _the_dashboard_lists_the_actors_on_each_host(info: dict, run_name: str) -> None:
    from browser import Page, chromium

    if chromium() is None:
        print("no chromium: the Dashboard was not opened")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forward = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "dashboard", "-p", str(port),
                                info["config"]], cwd=REPO, env=info["env"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    page = None
    try:
        deadline = time.time() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.time() < deadline and forward.poll() is None, "ray dashboard forwarded nothing"
                time.sleep(0.5)
        page = Page()
        page.open(f"http://127.0.0.1:{port}/#/actors")
        page.wait_for_text("Token", timeout=60)
        page.type_into("input[type=password]", (info["home"] / ".raysim" / "ray_token").read_text().strip())
        page.press_enter()
        text = page.wait_for_text("raysim-server", f"raysim-client-2.{run_name}", timeout=90)
        missing = [h.address for h in info["hosts"].hosts if h.address not in text]
        assert not missing, f"the Actors view names no actor on {missing}: {text[:3000]}"
    finally:
        if page is not None:
            page.close()
        os.killpg(forward.pid, signal.SIGTERM)
        forward.wait(timeout=30)


def test_data_store_files_on_hosts_that_share_no_folder(cluster, one_node):
    """data_store=files with the default folder, which only the head has: each worker host
    copies the arrays into its own home (data/replicate.py); the one-node model; a second
    run finds the copies. The bytes each worker host received are printed
    (benchmarks/cluster.py measures them per round)."""
    hosts = cluster["hosts"]
    before = [rx_bytes(h) for h in hosts.hosts[1:]]
    run = _run_on_head(cluster, "files", "data_store=files")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    first = [rx_bytes(h) - b for h, b in zip(hosts.hosts[1:], before)]
    assert _same(one_node["fedavg"], _model(cluster, "files"))
    head = list((hosts.hosts[0].folder / "home/.cache/raysim/arrays").glob("*/manifest.json"))
    assert len(head) == 1
    for h in hosts.hosts[1:]:  # its own copy, at the same path in its own home
        copy = h.folder / "home/.cache/raysim/arrays" / head[0].parent.name
        assert (copy / "x_train.npy").read_bytes() == (head[0].parent / "x_train.npy").read_bytes()
    before = [rx_bytes(h) for h in hosts.hosts[1:]]
    again = _run_on_head(cluster, "files-again", "data_store=files")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    second = [rx_bytes(h) - b for h, b in zip(hosts.hosts[1:], before)]
    took = json.loads((hosts.hosts[0].folder / "home/raysim/runs/files-again/summary.json").read_text())
    print(f"bytes received per worker host: first run {first}, second run {second}; the second run (hosts up, "
          f"no scaling): {took['seconds_to_end_of_round_1']:.1f} s to the end of round 1")
    assert _same(one_node["fedavg"], _model(cluster, "files-again"))


def test_a_host_whose_processes_all_die_mid_round_changes_no_result_and_comes_back(cluster, one_node):
    """In round 2 every process of host 2 dies (its clients kill them: the plugin), sshd
    aside. Its calls are made again on the other hosts' actors within the round; the log
    names the host; the model is the one-node run's; the autoscaler starts Ray on host 2
    again and the cluster has three nodes once more."""
    hosts = cluster["hosts"]
    run = _run_on_head(cluster, "lost", *LOSE)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    d = hosts.hosts[0].folder / "home" / "raysim" / "runs" / "lost"
    log = (d / "log.txt").read_text()
    lost = re.search(r"round 2: client actors? .*lost the call of clients \[.*\]; redone on actor \d.*", log)
    assert lost and hosts.hosts[2].address in lost.group(0), log
    rows = [c for c in pq.read_table(d / "clients.parquet").to_pylist() if c["method"] == "client_update"]
    assert not [c for c in rows if c["status"] != "ok"]
    assert {c["round"] for c in rows if c["redone"]} == {2}
    assert _same(one_node["lose"], _model(cluster, "lost"))
    # the autoscaler finds host 2 silent and starts Ray there again: its raylet is watched
    # from here (cheap), then the head is asked (a `ray exec` takes seconds); host 1 may be
    # stopped meanwhile, idle for idle_timeout_minutes (the next test)
    _wait_for(lambda: _raylet(hosts.hosts[2]) and hosts.hosts[2].address in alive_nodes(cluster), 240,
              "host 2 did not come back")


def _raylet(host) -> bool:
    return any("raylet" in p for p in _ray_processes(host))


def _wait_for(ready, seconds: float, why: str) -> None:
    deadline = time.time() + seconds
    while not ready():
        assert time.time() < deadline, why
        time.sleep(1)


def test_idle_worker_hosts_are_stopped_after_idle_timeout_minutes(cluster):
    workers = cluster["hosts"].hosts[1:]
    head = [cluster["hosts"].hosts[0].address]
    _wait_for(lambda: not any(_raylet(h) for h in workers) and alive_nodes(cluster) == head, IDLE_MINUTES * 60 + 180,
              f"worker hosts still up after idle_timeout_minutes={IDLE_MINUTES}")
