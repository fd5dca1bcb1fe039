"""Benchmark dataset, loaded through the `plugins` config key (`plugins=[bench_plugin]`):
`bench_images`, random 3x32x32 uint8 images (as every real image dataset is stored) with random
labels, `samples_per_client` per client
(the compute-bound workload; the overhead-bound one uses raysim's own `synthetic`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysim.data.datasets import FederatedData
from raysim.registry import DATASETS


@dataclass
class BenchConfig:
    samples_per_client: int = 500
    test_samples: int = 1000


@DATASETS.register("bench_images")
class BenchImages:
    Config = BenchConfig
    num_classes = 10

    @staticmethod
    def load(cfg) -> FederatedData:
        b = cfg.bench_images
        rng = np.random.default_rng(int(cfg.seed))
        n = int(cfg.num_clients) * int(b.samples_per_client) + int(b.test_samples)
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, n).astype(np.int64)
        t = int(b.test_samples)
        return FederatedData("bench_images", x[t:], y[t:], x[:t], y[:t], 10, norm=((0.5,) * 3, (0.25,) * 3),
                             pixel_max=255.0)
