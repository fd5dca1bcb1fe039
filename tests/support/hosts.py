"""Hosts of a test cluster, real enough to bring a cluster up on one machine (issue 53).

Each host is a Linux network namespace with its own address on a private bridge, links
shaped by `tc netem` (1 Gbit/s and 0.5 ms each way by default, so bytes cost time), and its
own sshd (Debian's openssh-server), started in mount and PID namespaces of its own where the
host's folders are bind-mounted over /root and /tmp (the machine's Python and this checkout
showing through, wherever they live, /tmp included): a process on a host (a login over SSH,
a Ray node) sees its own home and temp folder and its own processes (`ray stop` there stops
that host's Ray, nothing else), and reaches the other hosts only over the network. Everything else of the file system (the Python install, this repository) is the
machine's, as an image shared by cloud hosts would be; a test that needs a shared folder
says so.

`Hosts(n)` is a context manager; on exit, whatever happened, every process in the
namespaces is killed and the namespaces, veths and bridge are deleted. It needs root, `ip`,
`tc`, `unshare` and `/usr/sbin/sshd`: `missing()` says what is absent, for a skip line.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

SSHD = "/usr/sbin/sshd"


def missing() -> Optional[str]:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen", "rsync"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not os.path.exists(SSHD):
        return "needs Debian's openssh-server (.ci/run installs it)"
    return None


def _needed() -> list[str]:
    """The folders a host's Python needs of the machine's: its install and this repository."""
    import sys

    return [sys.base_prefix, sys.prefix, str(Path(__file__).resolve().parents[2])]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


class Host:
    def __init__(self, name: str, ns: str, address: str, folder: Path):
        self.name, self.ns, self.address, self.folder = name, ns, address, folder

    def run(self, command: str, env: Optional[dict] = None, timeout: float = 300, check: bool = True,
            key: Optional[Path] = None) -> subprocess.CompletedProcess:
        """`command` on this host over SSH, as root, in its home folder."""
        assert key is not None
        exports = "".join(f"export {k}={v!r}; " for k, v in (env or {}).items())
        r = subprocess.run(["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                            "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", f"root@{self.address}", exports + command],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{self.name}: {command!r} exited {r.returncode}: {r.stderr[-2000:]}")
        return r

    def pids(self) -> list[int]:
        out = _run("ip", "netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out]

    def kill_all(self) -> None:
        """Every process of this host dies at once (a power cut), sshd included."""
        for _ in range(5):
            pids = self.pids()
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


class Hosts:
    def __init__(self, n: int, rate: str = "1gbit", delay: str = "0.5ms"):
        self.n, self.rate, self.delay = n, rate, delay
        self.tag = secrets.token_hex(3)
        self.bridge = f"rsbr{self.tag}"
        octet = int(self.tag[:2], 16) % 200 + 20
        self.subnet = f"10.213.{octet}"
        self.gateway = f"{self.subnet}.1"
        self.root = Path(tempfile.mkdtemp(prefix=f"rshosts-{self.tag}-", dir="/var/tmp"))  # not under /tmp: hidden there
        self.key = self.root / "id_ed25519"
        self.hosts: list[Host] = []
        self._sshd: list[subprocess.Popen] = []
        self._made: list[tuple[str, str]] = []  # what close() deletes, in reverse
        self.shaping = f"netem rate {rate} delay {delay}"

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            self._add_host(i)
        for h in self.hosts:
            self._wait_for_sshd(h)
        for i in range(self.n):
            self._python_env(i)

    def _add_host(self, i: int) -> None:
        name, ns = f"host{i}", f"rs{self.tag}h{i}"
        address = f"{self.subnet}.{i + 2}"
        folder = self.root / name
        for sub in ("home/.ssh", "home/.config/pip", "tmp", "etc"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        (folder / "tmp").chmod(0o1777)
        shutil.copy(f"{self.key}.pub", folder / "home/.ssh/authorized_keys")
        path = f"/root/venv/bin:{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        (folder / "home/.ssh/environment").write_text(f"PATH={path}\n")
        # no network beyond the bridge: pip takes what the machine has (no index; builds without
        # fetching setuptools: pip reads `no-build-isolation = false` as "do not isolate")
        (folder / "home/.config/pip/pip.conf").write_text("[global]\nno-index = true\nno-build-isolation = false\n")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "etc/host_key"))
        (folder / "etc/sshd_config").write_text(
            f"ListenAddress {address}\nPort 22\nHostKey {folder}/etc/host_key\nPidFile {folder}/etc/sshd.pid\n"
            f"AuthorizedKeysFile {folder}/home/.ssh/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nUsePAM no\nStrictModes no\nPermitUserEnvironment yes\nAcceptEnv *\n"
            "Subsystem sftp internal-sftp\n")
        veth = f"rs{self.tag}v{i}"
        _run("ip", "netns", "add", ns)
        self._made.append(("netns", ns))
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._made.append(("link", veth))
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
                    ["ip", "link", "set", "eth0", "up"], ["ip", "route", "add", "default", "via", self.gateway]):
            _run("ip", "netns", "exec", ns, *cmd)
        netem = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "rate", self.rate,
                     "delay", self.delay, check=False)
        if netem.returncode != 0:  # a kernel without sch_netem: the rate alone, by a token bucket
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate,
                 "burst", "256kb", "latency", "50ms")
            self.shaping = f"tbf {self.rate} (this kernel has no netem: no added delay)"
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder
        # its own mount namespace: the host's folder over /root, for sshd and all it starts; what
        # the machine's Python needs from /root (pyenv's install, a repository there) shows through
        keep = sorted({Path(p).relative_to("/root").parts[0] for p in _needed() if Path(p).is_relative_to("/root")
                       and p != "/root"})
        binds = "".join(f"mkdir -p {folder}/home/{k} && mount --bind /root/{k} {folder}/home/{k} && " for k in keep)
        # and from /tmp, which the host's own /tmp hides: a venv or a checkout made there
        keep_tmp = sorted({Path(p).relative_to("/tmp").parts[0] for p in _needed() if Path(p).is_relative_to("/tmp")
                           and p != "/tmp"})
        binds += "".join(f"mkdir -p {folder}/tmp/{k} && mount --bind /tmp/{k} {folder}/tmp/{k} && " for k in keep_tmp)
        script = (f"mount --make-rprivate / && {binds}mount --rbind {folder}/home /root "
                  f"&& mount --rbind {folder}/tmp /tmp && exec {SSHD} -D -e -f {folder}/etc/sshd_config")
        log = open(folder / "etc/sshd.log", "w")
        # and its own PID namespace: `ray stop` on a host sees that host's processes only
        self._sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--pid", "--fork",
                                            "--mount-proc", "sh", "-c", script],
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.hosts.append(Host(name, ns, address, folder))

    def _python_env(self, i: int) -> None:
        """Host i's Python: a venv in its home over the machine's packages, first on PATH in
        its shell files (a login shell's /etc/profile resets PATH), so what a host pip-installs
        lands in its own home, as on a host with a disk of its own."""
        h = self.hosts[i]
        bin_dirs = f"/root/venv/bin:{Path(sys.executable).parent}"
        for name in (".bashrc", ".profile"):  # as /etc/skel gives a new user
            (h.folder / "home" / name).write_text(f"export PATH={bin_dirs}:$PATH\n")
        self.run(i, f"{sys.executable} -m venv --system-site-packages --without-pip /root/venv")
        # its pip: the machine's pip module run by the venv's Python, so it installs into the venv
        # (the venv's own bundled setuptools would shadow the machine's, which builds offline)
        shim = h.folder / "home/venv/bin/pip"
        shim.write_text("#!/root/venv/bin/python\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n")
        shim.chmod(0o755)

    def _wait_for_sshd(self, h: Host, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with socket.create_connection((h.address, 22), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{h.name}: sshd did not start: {(h.folder / 'etc/sshd.log').read_text()[-1000:]}")

    def run(self, i: int, command: str, **kw) -> subprocess.CompletedProcess:
        return self.hosts[i].run(command, key=self.key, **kw)

    def close(self) -> None:
        for h in self.hosts:
            h.kill_all()
        for p in self._sshd:
            try:
                p.kill()
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for kind, name in reversed(self._made):
            if kind == "netns":
                for p in _run("ip", "netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(p), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
            _run("ip", kind, "del", name, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
