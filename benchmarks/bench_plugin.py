"""Benchmark dataset, loaded through the `plugins` config key (`plugins=[bench_plugin]`):
`bench_images`, random 3x32x32 (or `channels` x `size` x `size`) uint8 images (as every real image dataset is stored) with random
labels, `samples_per_client` per client
(the compute-bound workload; the overhead-bound one uses raysim's own `synthetic`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysim.data.datasets import FederatedData
from raysim.options import Options, option
from raysim.registry import DATASETS


@dataclass
class BenchOptions(Options):
    samples_per_client: int = option(500, at_least=1)
    test_samples: int = option(1000, at_least=1)
    channels: int = option(3, at_least=1)  # 1 and size 28: MNIST's shape
    size: int = option(32, at_least=8)


@DATASETS.register("bench_images")
class BenchImages:
    Options = BenchOptions
    num_classes = 10

    @staticmethod
    def load(cfg) -> FederatedData:
        b = cfg.bench_images
        rng = np.random.default_rng(int(cfg.seed))
        n = int(cfg.num_clients) * int(b.samples_per_client) + int(b.test_samples)
        c, h = int(b.channels), int(b.size)
        x = rng.integers(0, 256, (n, c, h, h), dtype=np.uint8)
        y = rng.integers(0, 10, n).astype(np.int64)
        t = int(b.test_samples)
        return FederatedData("bench_images", x[t:], y[t:], x[:t], y[:t], 10, norm=((0.5,) * c, (0.25,) * c),
                             pixel_max=255.0)
