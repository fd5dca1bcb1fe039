"""Hardening, part 5 (issue 85), through the real CLI and tools: one process a run
directory, the files the sweep and table tools read, signals at start-up, options read by
nothing, and limits that were not checked."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = ["dataset=digits", "model=mclr", "num_clients=6", "local.epochs=1"]


def cli(args: list, cwd, timeout: float = 180, module: str = "raysim.run", **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, **kw)


def one_error(r: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one line a refused command prints (progress lines aside)."""
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("raysim [")]
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


# ---------------------------------------------------------------- one process a run directory
def test_a_resume_of_a_run_its_first_process_still_drives_is_refused(tmp_path):
    """Only resumed runs took the lock: `resume=DIR` of a run still in its first process was
    accepted, both drove the directory, and the first died writing its checkpoint."""
    run = tmp_path / "runs" / "r"
    first = subprocess.Popen([sys.executable, "-m", "raysim.run", *SMALL, "rounds=400", "run_name=r",
                              f"output_dir={tmp_path / 'runs'}", "--quiet"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 150
        while not (run / "checkpoint.pt").exists():  # a round has ended: a resume would find a checkpoint
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = cli([f"resume={run}", "--quiet"], tmp_path, timeout=120)
        assert f"{run} is in use: process {first.pid} on " in one_error(second), second.stderr
        assert first.poll() is None  # the first goes on, untouched
    finally:
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    assert first.returncode == 130 and f"resume={run}" in err, err  # stopped cleanly, lock given back
    assert not (run / ".lock").exists()
