"""No store to size by hand. With `data_store=auto` (the default) training data that would crowd
the object store go to files instead (raysim/data/store.py); with `data_store=memory` a local
Ray the command started with Ray's default store is restarted once with a bigger one (Ray
spills what does not fit to disk and reads it back every round: 2.7x slower measured)."""
import os
import subprocess
import sys

from raysim.runtime.placement import store_size_for

GiB = 2**30


def test_the_store_is_sized_only_when_the_data_crowd_it_and_the_machine_has_room():
    assert store_size_for(int(0.7 * GiB), 1 * GiB, 20 * GiB, 20 * GiB) is None  # fits (at most 70 %)
    assert store_size_for(int(6 * GiB), 7.2 * GiB, 20 * GiB, 20 * GiB) == 10 * GiB  # 6 / 0.6 = 10 GiB
    assert store_size_for(int(0.9 * GiB), 1 * GiB, 20 * GiB, 20 * GiB) == int(1.5 * GiB)  # rounded up to 0.5 GiB
    assert store_size_for(int(6 * GiB), 7.2 * GiB, 16 * GiB, 20 * GiB) is None  # over half the free memory
    assert store_size_for(int(6 * GiB), 7.2 * GiB, 40 * GiB, 8 * GiB) is None  # over 90 % of /dev/shm
    assert store_size_for(100, 0, 20 * GiB, 20 * GiB) is None  # no store reported: nothing to compare


PLUGIN = '''
import numpy as np
from raysim.data.datasets import FederatedData
from raysim.registry import DATASETS


@DATASETS.register("big_vectors")
class BigVectors:
    num_classes = 2

    @staticmethod
    def load(cfg):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((17_000, 1_000), dtype=np.float32)  # 64 MB of training inputs
        y = (x[:, 0] > 0).astype(np.int64)
        return FederatedData("big_vectors", x[:16_000], y[:16_000], x[16_000:], y[16_000:], 2)
'''


def test_data_that_would_crowd_the_store_go_to_files_or_with_memory_the_store_is_resized(tmp_path):
    import torch

    (tmp_path / "big_plugin.py").write_text(PLUGIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES=str(75 * 2**20))  # Ray's smallest store: 75 MiB
    args = ["resources.ray_start_s=0", "plugins=[big_plugin]", "dataset=big_vectors", "model=mclr", "rounds=1", "num_clients=4", "partition=iid",
            f"data_store_dir={tmp_path / 'arrays'}"]
    r = subprocess.run([sys.executable, "-m", "raysim.run", *args, "run_name=auto"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restarting" not in r.stderr and "note:" not in r.stderr, r.stderr  # data_store=auto: no store to size
    log = (tmp_path / "runs" / "auto" / "log.txt").read_text()
    assert f"GB in files under {tmp_path / 'arrays'}" in log and "(data_store=auto)" in log, log
    r = subprocess.run([sys.executable, "-m", "raysim.run", *args, "data_store=memory", "run_name=sized"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: the training data (0.1 GB) would take 8" in r.stderr and "restarting it with 0.5 GB" in r.stderr, \
        r.stderr
    assert "take" not in r.stderr.split("restarting it with")[1].split("final accuracy")[0]  # no notice after it
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["auto", "sized"]  # the first attempt wrote nothing
    assert "GB in Ray's object store (data_store=memory)" in (tmp_path / "runs" / "sized" / "log.txt").read_text()
    a, b = (torch.load(tmp_path / "runs" / n / "model.pt", weights_only=True)["global"] for n in ("auto", "sized"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a store the user set is theirs: said, not changed (tests/test_vectorized.py, ray.object_store_gb=0.1)
