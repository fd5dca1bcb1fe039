"""Every algorithm (and every client selection) trained for a few rounds on digits, and the
sha256 of its final model: the check that a refactor changed no result, bit for bit.

    python benchmarks/model_hashes.py --write benchmarks/results-model-hashes.txt   # before
    python benchmarks/model_hashes.py --check benchmarks/results-model-hashes.txt   # after

The hash covers every tensor of `model.pt` (names, dtypes, shapes and bytes, in name
order) and every other value in it. Runs share one local Ray (`raysim.simulate`); about 3
minutes on 2 cores. Exit status 1 when `--check` finds a differing hash.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

BASE = {"dataset": "digits", "num_clients": 8, "participation": 0.5, "rounds": 3, "seed": 0,
        "local.epochs": 1, "checkpoint_every": 0}
# (name, overrides): every registered algorithm with its config group, the selections, and
# runtime paths that must not change a result (vectorised cohorts, client state, BatchNorm)
CASES = [(a, {"algorithm": a}) for a in (
    "fedavg", "fedprox", "fedavgm", "fednova", "scaffold", "moon", "fedlc", "fedrs", "fedfocal",
    "fedavg_taunorm", "ccvr", "creff", "ifca", "fesem", "fedgroup", "fedgrouprox")] + [
    ("fed2", {"algorithm": "fed2", "rounds": 2}),
    ("fedconcat", {"algorithm": "fedconcat", "fedconcat.clusters": 2, "fedconcat.encoder_rounds": 2}),
    ("fedconcat_id", {"algorithm": "fedconcat_id", "fedconcat.clusters": 2, "fedconcat.encoder_rounds": 2}),
    ("fedavg+fedentopt", {"selection": "fedentopt"}),
    ("fedavg+kl", {"selection": "kl"}),
    ("fedavg+vectorize", {"model": "mclr", "local.vectorize": True}),
    ("fedavgm+vgg9-batchnorm", {"algorithm": "fedavgm", "model": "vgg9", "model_options.norm": "batch", "rounds": 2}),
    ("scaffold+vgg9-batchnorm", {"algorithm": "scaffold", "model": "vgg9", "model_options.norm": "batch", "rounds": 2}),
] + [(a, {"algorithm": a, "partition.test_fraction": 0.2}) for a in (  # personalised: local test splits set
    "fedper", "fedrep", "lg_fedavg", "ditto", "apfl", "fedbabu")] + [
    # simulated time: who is online, who misses the deadline (world/; run from the repository root)
    ("fedavg+mobile-deadline-diurnal", {"system.profile": "mobile", "system.deadline": 2.0,
                                        "system.availability": "diurnal", "system.online_hours": 12}),
    ("fedavg+traces", {"system.profile": "trace", "system.trace": "examples/device_trace.csv",
                       "system.availability": "trace", "system.availability_trace": "examples/availability_trace.csv"}),
    ("fedbuff", {"algorithm": "fedbuff", "fedbuff.concurrency": 4, "fedbuff.buffer": 2}),
    ("fedasync", {"algorithm": "fedasync", "fedasync.concurrency": 4, "fedasync.updates_per_round": 2}),
]


def model_hash(path: Path) -> str:
    import torch

    h = hashlib.sha256()

    def feed(key: str, v) -> None:
        h.update(key.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous().reshape(-1)  # 0-dim tensors (counters) cannot be viewed as bytes
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                feed(f"{key}/{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                feed(f"{key}[{i}]", x)
        else:
            h.update(repr(v).encode())

    feed("", torch.load(path, map_location="cpu", weights_only=False))
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="record the hashes in this file")
    ap.add_argument("--check", type=Path, help="compare with the hashes recorded in this file")
    ap.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = ap.parse_args()
    import raysim

    recorded = {}
    if args.check:
        for line in args.check.read_text().splitlines():
            if line and not line.startswith("#"):
                name, digest = line.split()[:2]
                recorded[name] = digest
    lines, differ = [], []
    with tempfile.TemporaryDirectory() as out:
        for name, over in CASES:
            if args.only and name not in args.only:
                continue
            res = raysim.simulate({**BASE, **over, "output_dir": out, "run_name": name.replace("+", "_")}, progress=False)
            digest = model_hash(res.run_dir / "model.pt")
            verdict = "" if not recorded else ("same" if recorded.get(name) == digest else "DIFFERS")
            if verdict == "DIFFERS":
                differ.append(name)
            lines.append(f"{name} {digest} {res.summary['final_accuracy']:.4f}")
            print(f"{lines[-1]} {verdict}", flush=True)
    raysim.shutdown()
    if args.write:
        args.write.write_text("# name sha256(model.pt) final_accuracy; python benchmarks/model_hashes.py --write "
                              f"{args.write}\n" + "\n".join(lines) + "\n")
    if differ:
        print(f"{len(differ)} of {len(lines)} differ: {', '.join(differ)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
