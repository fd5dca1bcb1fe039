"""`ray up` for real (issue 53): three hosts on this machine (tests/support/hosts.py: network
namespaces on a private bridge, each with its own sshd, home, /tmp and processes), the shipped
cluster-onprem.yaml changed only in its EDIT fields, then the docs' own commands: `ray up`,
`ray exec ... python -m raysim.run ray.address=auto ...`, `ray rsync-down`, `ray down`.

Slow (about two minutes) and root-only; skipped with the reason elsewhere."""
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from raysim.run import main

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
from hosts import Hosts, missing  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=f"hosts: {missing()}")]

RUN = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "rounds=3", "local.epochs=1",
       "local.batch_size=16", "resources.num_actors=3", "--quiet"]


def ray_cli(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`ray up` of cluster-onprem.yaml on three hosts; `ray down` and the hosts' removal after."""
    home = tmp_path_factory.mktemp("user-home")  # the user's machine: its ~ holds the cluster's token
    (home / ".raysim").mkdir()
    (home / ".raysim" / "ray_token").write_text(secrets.token_hex(32))
    (home / ".raysim" / "ray_token").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    with Hosts(3) as hosts:
        cfg = yaml.safe_load((REPO / "cluster-onprem.yaml").read_text())
        cfg["provider"]["head_ip"] = hosts.hosts[0].address  # the EDIT fields, and nothing else
        cfg["provider"]["worker_ips"] = [h.address for h in hosts.hosts[1:]]
        cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(hosts.key)}
        path = home / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))
        t0 = time.time()
        up = ray_cli("up", "-y", "--no-config-cache", str(path), env=env, timeout=900)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        info = {"hosts": hosts, "config": str(path), "env": env, "up_seconds": time.time() - t0}
        try:
            deadline = time.time() + 300  # the head's autoscaler starts the workers over SSH
            while time.time() < deadline:
                r = ray_cli("exec", str(path), "python -c 'import ray; ray.init(); "
                            "print(\"nodes\", sum(n[\"Alive\"] for n in ray.nodes()))'", env=env, timeout=300)
                if "nodes 3" in r.stdout:
                    break
                time.sleep(5)
            else:
                pytest.fail(f"the workers did not join within 300 s: {(r.stdout + r.stderr)[-3000:]}")
            info["nodes_seconds"] = time.time() - t0
            yield info
        finally:
            down = ray_cli("down", "-y", str(path), env=env, timeout=300)
            deadline = time.time() + 30  # agents exit shortly after their raylet
            while True:
                left = {h.name: _ray_processes(h) for h in hosts.hosts}
                if not any(left.values()) or time.time() > deadline:
                    break
                time.sleep(1)
        assert down.returncode == 0, (down.stdout + down.stderr)[-2000:]
        # `ray down` stopped Ray on every host: no raylet, no GCS. (A worker's dashboard and
        # runtime-env agents were seen to outlive it here, reparented to the host's sshd:
        # issue 53's notes; the hosts' removal kills them.)
        stopped = {name: [p for p in procs if "raylet" in p or "gcs_server" in p] for name, procs in left.items()}
        assert not any(stopped.values()), stopped


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
            names.append(cmd[:80])
    return names


def test_ray_up_then_the_docs_commands_run_across_hosts_with_the_one_node_model(ray_local, cluster, tmp_path):
    path, env, hosts = cluster["config"], cluster["env"], cluster["hosts"]
    run = ray_cli("exec", path, f"cd ~/raysim && python -m raysim.run ray.address=auto {' '.join(RUN)} "
                  "output_dir=runs run_name=cluster", env=env, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    got = ray_cli("rsync-down", path, "~/raysim/runs/cluster/", str(tmp_path / "cluster"), env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert len(summary["client_actor_nodes"]) == 3, summary["client_actor_nodes"]  # one actor on each host
    # the same run on one node (the test session's Ray), bit for bit
    assert main([*RUN, "resources.num_actors=1", f"output_dir={tmp_path}", "run_name=one"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("cluster", "one"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    # each host's run directory is its own: only the head (where the command ran) has it
    assert (hosts.hosts[0].folder / "home" / "raysim" / "runs" / "cluster").is_dir()
    assert not (hosts.hosts[1].folder / "home" / "raysim" / "runs" / "cluster").exists()
