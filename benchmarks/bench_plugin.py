"""Benchmark dataset, loaded through the `plugins` config key (`plugins=[bench_plugin]`):
`bench_images`, random 3x32x32 (or `channels` x `size` x `size`) images with random labels,
`samples_per_client` per client (the compute-bound workload; the overhead-bound one uses
raysim's own `synthetic`). Pixels are uint8 as every real image dataset is stored, or, with
`dtype=float32`, standard-normal float32 features (issue 42's 5.7 GB and 30 GB workloads).

It makes its arrays in chunks (`generate`, raysim/data/store.py), so with `data_store=files`
a dataset larger than memory is written straight to disk, once per key, never held whole."""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from omegaconf import OmegaConf

from raysim.data import store
from raysim.data.datasets import FederatedData
from raysim.options import Options, option
from raysim.registry import DATASETS

CHUNK = 8192  # samples drawn at a time


@dataclass
class BenchOptions(Options):
    samples_per_client: int = option(500, at_least=1)
    test_samples: int = option(1000, at_least=1)
    channels: int = option(3, at_least=1)  # 1 and size 28: MNIST's shape
    size: int = option(32, at_least=8)
    dtype: str = option("uint8", choices=("uint8", "float32"))


@DATASETS.register("bench_images")
class BenchImages:
    Options = BenchOptions
    num_classes = 10

    @staticmethod
    def arrays_key(cfg) -> dict:
        return {"seed": int(cfg.seed), "num_clients": int(cfg.num_clients), **OmegaConf.to_container(cfg.bench_images)}

    @staticmethod
    def train_bytes(cfg) -> int:
        b = cfg.bench_images
        n = int(cfg.num_clients) * int(b.samples_per_client)
        return n * (int(b.channels) * int(b.size) ** 2 * (1 if b.dtype == "uint8" else 4) + 8)

    @staticmethod
    def generate(cfg, out) -> None:
        """Chunk i of the training set is drawn from its own generator, seeded (seed, i), a few
        chunks at once on threads (numpy's generators release the GIL), written in order."""
        b = cfg.bench_images
        c, h, t = int(b.channels), int(b.size), int(b.test_samples)
        n = int(cfg.num_clients) * int(b.samples_per_client)
        seed = int(cfg.seed)

        def draw(rng, k: int) -> np.ndarray:
            if b.dtype == "uint8":
                return rng.integers(0, 256, (k, c, h, h), dtype=np.uint8)
            return rng.standard_normal((k, c, h, h), dtype=np.float32)

        def chunk(a: int) -> tuple:
            rng = np.random.default_rng([seed, a // CHUNK])
            k = min(CHUNK, n - a)
            return draw(rng, k), rng.integers(0, 10, k)

        test = np.random.default_rng([seed, -1 % 2**32])
        out.put("x_test", draw(test, t))
        out.put("y_test", test.integers(0, 10, t))
        x = out.array("x_train", (n, c, h, h), np.uint8 if b.dtype == "uint8" else np.float32)
        y = out.array("y_train", (n,), np.int64)
        threads = min(4, len(os.sched_getaffinity(0)))
        with ThreadPoolExecutor(threads) as pool:
            ahead: deque = deque()  # at most 2 chunks per thread drawn ahead of the writes: memory stays small
            for a in [*range(0, n, CHUNK), None]:
                if a is not None:
                    ahead.append((a, pool.submit(chunk, a)))
                while ahead and (a is None or len(ahead) > 2 * threads):
                    at, done = ahead.popleft()
                    xs, ys = done.result()
                    x[at:at + len(xs)] = xs
                    y[at:at + len(ys)] = ys

    @staticmethod
    def load(cfg) -> FederatedData:
        arrays, manifest = store.generated(BenchImages, cfg)
        c = int(cfg.bench_images.channels)
        images = cfg.bench_images.dtype == "uint8"
        return FederatedData("bench_images", arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                             10, norm=((0.5,) * c, (0.25,) * c) if images else None,
                             pixel_max=255.0 if images else None, stored=manifest)
