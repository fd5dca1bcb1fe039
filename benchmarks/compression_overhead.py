"""What `compress.up` costs on this machine's CPU, per round, side by side in one run.

    python benchmarks/compression_overhead.py                     # cnn and mlp workloads, every codec
    python benchmarks/compression_overhead.py --workloads cnn --repeat 3

For each workload of benchmarks/throughput.py (the same data, model, clients and recipe) and
each codec, this runs `python -m raysim.run` as a fresh process with `compress.up=none` and
with the codec, in turn, and prints the median seconds per round after the first and their
ratio (the codec's round / the plain round), with the bytes a client sent. It also times the
codec itself on this CPU, in this process: one encode (on the client) and one decode (on the
server) of an update the model's size, and what a round's clients add up to (`clients x
(encode + decode)`), which is the part of the ratio compression itself accounts for.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import throughput  # noqa: E402  (the workloads and their bench plugin)

CODECS = {
    "topk 1%": ["compress.up=topk", "compress.ratio=0.01"],
    "topk 1% + EF": ["compress.up=topk", "compress.ratio=0.01", "compress.error_feedback=true"],
    "randk 10%": ["compress.up=randk", "compress.ratio=0.1"],
    "qsgd 4 bits": ["compress.up=qsgd", "compress.bits=4"],
    "qsgd 8 bits": ["compress.up=qsgd", "compress.bits=8"],
    "scaled sign": ["compress.up=sign"],
}


def run(name: str, extra: list[str]) -> dict:
    """A fresh `raysim.run` process: its rounds' seconds and a client's bytes sent."""
    import os

    import pyarrow.parquet as pq

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "raysim.run", "--quiet", *throughput.overrides(name), *extra,
               f"output_dir={tmp}", "run_name=r"]
        r = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(extra) or 'plain'} failed:\n{r.stderr[-3000:]}")
        rows = pq.read_table(Path(tmp) / "r" / "metrics.parquet").to_pylist()
    secs = [row["seconds"] for row in rows][1:]
    return {"median_round_seconds": statistics.median(secs),
            "bytes_per_client": rows[-1]["round_bytes_up"] / max(1, rows[-1]["clients"])}


def codec_seconds(name: str, extra: list[str]) -> tuple[float, float, int]:
    """(encode s, decode s, a client's bytes) for one update of the workload's model, in this process."""
    import torch

    from raysim.compression.uplink import Uplink
    from raysim.config import load_config
    from raysim.experiment import prepare
    from raysim.models import model_from
    from raysim.seeds import seed_for

    torch.set_num_threads(1)
    cfg = load_config(overrides=[*throughput.overrides(name), *extra])
    data, _, classes = prepare(cfg)
    model = model_from(cfg, tuple(data.input_shape), classes)
    uplink = Uplink.from_config(cfg, model)
    weights = model.state_dict()
    n = sum(weights[k].numel() for k in uplink.keys)
    v = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.01
    enc, dec = [], []
    for i in range(7):
        g = torch.Generator().manual_seed(seed_for(0, i, 1))
        t0 = time.perf_counter()
        m = uplink.codec.encode(v, g)
        t1 = time.perf_counter()
        uplink.codec.decode(m, torch.Generator().manual_seed(seed_for(0, i, 1)))
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return statistics.median(enc), statistics.median(dec), uplink.message_bytes(weights)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["cnn", "mlp"], choices=list(throughput.WORKLOADS))
    p.add_argument("--repeat", type=int, default=1, help="runs of each pair; the table shows the median ratio")
    args = p.parse_args()
    for name in args.workloads:
        print(f"== {name}: {' '.join(throughput.WORKLOADS[name])}")
        print(f"{'codec':<16}{'plain s/rd':>11}{'codec s/rd':>11}{'ratio':>8}{'B/client':>11}"
              f"{'encode ms':>11}{'decode ms':>11}{'clients x (e+d) s':>19}")
        for label, extra in CODECS.items():
            pairs = []
            for _ in range(args.repeat):
                plain, coded = run(name, []), run(name, extra)
                pairs.append((coded["median_round_seconds"] / plain["median_round_seconds"], plain, coded))
            ratio, plain, coded = sorted(pairs, key=lambda t: t[0])[len(pairs) // 2]
            e, d, size = codec_seconds(name, extra)
            clients = int(next(o.split("=")[1] for o in throughput.overrides(name) if o.startswith("clients_per_round=")))
            print(f"{label:<16}{plain['median_round_seconds']:>11.4f}{coded['median_round_seconds']:>11.4f}{ratio:>7.2f}x"
                  f"{coded['bytes_per_client']:>11.0f}{e * 1e3:>11.2f}{d * 1e3:>11.2f}{clients * (e + d):>19.4f}")
            assert coded["bytes_per_client"] == size, (coded["bytes_per_client"], size)  # the table's bytes are the messages'
        print(json.dumps({"plain_bytes_per_client": plain["bytes_per_client"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
