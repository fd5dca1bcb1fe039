import os
import sys
from pathlib import Path

import pytest

SUPPORT = str(Path(__file__).parent / "support")
BENCHMARKS = str(Path(__file__).parent.parent / "benchmarks")  # bench_plugin, for benchmarks/gpu.py --dry
sys.path.insert(0, SUPPORT)
sys.path.insert(1, BENCHMARKS)
# A warm service the developer started (python -m raysim.up) must not run the tests' commands:
# they see a service folder of their own (tests/test_service.py starts one there).
os.environ["RAYSIM_SERVICE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"raysim-tests-{os.getpid()}")
# The prepared-data cache (raysim/data/cache.py) starts empty in every session, and goes with it.
os.environ["RAYSIM_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"raysim-tests-cache-{os.getpid()}")
# Ray worker processes inherit the environment of the process that starts Ray.
os.environ["PYTHONPATH"] = os.pathsep.join([SUPPORT, BENCHMARKS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): the whole suite on two worker processes, each test
    module whole on one of them (`--dist loadfile`), where the machine has two CPUs or more:
    on 2 cores 1,802 s against ~2,170 s in one process (benchmarks/results-suite-time-cpu-2core.txt;
    three workers measured no faster, 1,377 s against 1,341 s: the tests slow each other and torch's
    thread pools spin on busy cores). A chosen
    file or test runs in this process (0): no workers to start, and a debugger works.
    PYTEST_XDIST_AUTO_NUM_WORKERS sets the number."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    tests = Path(__file__).resolve().parent
    chosen = [a for a in config.args if Path(a.split("::")[0]).resolve() not in (tests, tests.parent)]
    workers = min(2, os.cpu_count() or 1)
    return 0 if chosen or workers < 2 else workers  # one worker would only add its start


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(os.environ["RAYSIM_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray instance for the session (4 logical CPUs so 3 actors fit)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_tmp():
    """A RAY_TMPDIR of this test's own (short: Ray's socket paths are limited); with
    `own_ray.under(ray_tmp)` the test finds the Ray processes its commands started."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
