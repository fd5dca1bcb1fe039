"""Does training learn on real data? FedAvg and FedProx on real MNIST images, offline.

    python benchmarks/accuracy_mnist.py [--mnist-dir ../shared/data/mnist-t10k] [--rounds 20]

Machines without internet have only MNIST's 10,000 test images (`t10k-*-idx*-ubyte.gz`).
This script splits them 8,000 / 2,000 into train / test, writes them in MNIST's own IDX
format under a temporary `data_dir/MNIST/raw/`, and runs raysim's real MNIST loader on
them: 20 clients, Dirichlet(0.5) label skew, half of them per round, simple CNN.
Prints each run's final and best accuracy (chance is 0.10).
"""
from __future__ import annotations

import argparse
import gzip
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def write_idx(path: Path, arr: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def write_split(source: Path, data_dir: Path) -> None:
    """MNIST's 10,000 test images from `source`, split 8,000 / 2,000 into train / test and
    written in MNIST's own IDX format under `data_dir/MNIST/raw/` for raysim's loader."""
    images = read_idx(source / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(source / "t10k-labels-idx1-ubyte.gz")
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw / "train-images-idx3-ubyte", images[:8000])
    write_idx(raw / "train-labels-idx1-ubyte", labels[:8000])
    write_idx(raw / "t10k-images-idx3-ubyte", images[8000:])
    write_idx(raw / "t10k-labels-idx1-ubyte", labels[8000:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mnist-dir", type=Path, default=ROOT.parent / "shared" / "data" / "mnist-t10k")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--write-split", type=Path, metavar="DATA_DIR",
                   help="only write the 8,000 / 2,000 split under DATA_DIR/MNIST/raw (the MNIST sweep files' data_dir)")
    args = p.parse_args()
    if args.write_split is not None:
        write_split(args.mnist_dir, args.write_split)
        print(f"written: {args.write_split / 'MNIST' / 'raw'}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write_split(args.mnist_dir, Path(tmp) / "data")
        common = ["dataset=mnist", f"data_dir={tmp}/data", "download=false", "model=cnn", "partition=dirichlet",
                  "partition.beta=0.5", "num_clients=20", "participation=0.5", f"rounds={args.rounds}",
                  "local.epochs=1", "local.batch_size=32", "local.lr=0.05", f"output_dir={tmp}/runs", "--quiet"]
        for algo in (["algorithm=fedavg"], ["algorithm=fedprox", "fedprox.mu=0.01"]):
            name = algo[0].split("=")[1]
            r = subprocess.run([sys.executable, "-m", "raysim.run", *common, *algo, f"run_name={name}"],
                               cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            s = json.loads((Path(tmp) / "runs" / name / "summary.json").read_text())
            print(f"{name:<8} final accuracy {s['final_accuracy']:.4f}  best {s['best_accuracy']:.4f}  "
                  f"({s['rounds']} rounds, {s['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
