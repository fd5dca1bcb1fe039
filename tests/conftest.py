import os
import sys
from pathlib import Path

import pytest

SUPPORT = str(Path(__file__).parent / "support")
sys.path.insert(0, SUPPORT)
# Ray worker processes inherit the environment of the process that starts Ray.
os.environ["PYTHONPATH"] = os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray instance for the session (4 logical CPUs so 3 actors fit)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
