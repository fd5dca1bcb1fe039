"""raysim on one GPU: issue 41's table in one command, with the bit-identity checks.

    python benchmarks/gpu.py                             # on a GPU machine: ~4 minutes
    python benchmarks/gpu.py --dry --out /tmp/gpu.txt    # CPU, tiny sizes: the suite runs this

Rows (FedAvg, the MNIST split of `benchmarks/accuracy_mnist.py --write-split`, `--data`):
- cnn, 100 clients, 20 a round, E=2, B=32: 4 actors x 0.25 GPU, 8 x 0.125, 1 x 1.0, 4 x 0.25
  with `determinism=false`, 16 CPU actors, a plain torch loop on the GPU;
- VGG-9, 20 clients, 10 a round, E=2: 4 x 0.25 (each actor's clients in up to 4 tasks, so
  the server folds while they train), the same in one task per actor, vectorised, with
  `determinism=false`, a plain loop on the GPU;
- cnn, 1,000 clients x 8 samples, all a round, E=1, B=8: vectorised 4 x 0.25 (groups of
  250), 1 x 1.0 (one group of 1,000), 4 x 0.25 not vectorised, 16 CPU actors vectorised,
  a plain loop on the GPU.
Each raysim row: the median of its rounds after the first of `seconds` (the round without
evaluation), `train_seconds` (waiting for the clients) and `aggregate_seconds` (the
server's own work); the plain loop: the median of 3 rounds after a first one, in this
process, the shards on the GPU.

Bit identity: the SHA-256 of every tensor in `model.pt` (benchmarks/model_hashes.py's
hash), compared across a repeat and the packings 1, 2, 4 and 8 actors per GPU, for the
per-client path (cnn, 100 clients) and the vectorised one (cnn, 1,000 clients, groups of
250); and across a repeat of VGG-9. Printed and written with the table to
`benchmarks/results-gpu-<card>.txt` (or `--out`), line by line as rows finish, so a killed
run leaves what it measured.

`--dry`: one row of each code path (both identity checks included) on the CPU with tiny
random data (bench_images), 1 or 2 actors: what the suite runs, so that this script works
when a GPU comes. Exit status 1 when a set that must be bit-identical is not.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

COMMON = {"seed": 0, "local.weight_decay": 0, "selection": "random", "checkpoint_every": 0,
          "ray.dashboard": False, "local.lr": 0.01, "local.momentum": 0.9}


def workloads(dry: bool, data: Path) -> dict[str, dict]:
    """The three workloads: the MNIST split, or (dry) tiny random images of MNIST's shape."""
    if dry:
        images = {"plugins": ["bench_plugin"], "dataset": "bench_images", "bench_images.channels": 1,
                  "bench_images.size": 28, "bench_images.test_samples": 64}
        return {
            "cnn100": {**images, "model": "cnn", "bench_images.samples_per_client": 16, "num_clients": 8,
                       "clients_per_round": 4, "local.epochs": 2, "local.batch_size": 8, "partition": "iid",
                       "rounds": 3},
            "vgg9": {**images, "model": "vgg9", "bench_images.samples_per_client": 8, "num_clients": 4,
                     "clients_per_round": 2, "local.epochs": 1, "local.batch_size": 8, "partition": "iid",
                     "partition.min_size": 1, "rounds": 2},
            "cnn1000": {**images, "model": "cnn", "bench_images.samples_per_client": 8, "num_clients": 16,
                        "clients_per_round": 16, "local.epochs": 1, "local.batch_size": 8, "partition": "iid",
                        "partition.min_size": 1, "rounds": 3},
        }
    mnist = {"dataset": "mnist", "data_dir": str(data), "download": False, "input_scale": "unit"}
    return {
        "cnn100": {**mnist, "model": "cnn", "num_clients": 100, "clients_per_round": 20, "local.epochs": 2,
                   "local.batch_size": 32, "partition": "iid", "rounds": 8},
        "vgg9": {**mnist, "model": "vgg9", "num_clients": 20, "clients_per_round": 10, "local.epochs": 2,
                 "local.batch_size": 32, "partition": "iid", "rounds": 6},
        "cnn1000": {**mnist, "model": "cnn", "num_clients": 1000, "clients_per_round": 1000, "local.epochs": 1,
                    "local.batch_size": 8, "partition": "iid", "partition.min_size": 1, "rounds": 8},
    }


def rows(dry: bool) -> list[tuple[str, str, dict, str]]:
    """(workload, label, overrides of the way, identity set) for every raysim row. `actors`
    client actors share one GPU (`1/actors` of it each), or the CPUs; dry: at most 2 actors,
    all on the CPU."""
    spec = [  # (workload, actors, on the GPU, extra overrides, note, identity set, run dry too)
        ("cnn100", 4, True, {}, "", "per-client", True),
        ("cnn100", 8, True, {}, "", "per-client", False),
        ("cnn100", 2, True, {}, "", "per-client", False),
        ("cnn100", 1, True, {}, "", "per-client", True),
        ("cnn100", 4, True, {"ray.reuse_workers": False}, "repeated, fresh actors", "per-client", True),
        ("cnn100", 4, True, {"determinism": False}, "determinism=false", "", True),
        ("cnn100", 16, False, {}, "", "", False),
        ("cnn100", 0, True, {"resources.num_gpus_per_actor": "auto"}, "num_gpus_per_actor=auto", "per-client", True),
        ("vgg9", 4, True, {}, "", "vgg9", True),
        ("vgg9", 4, True, {"ray.reuse_workers": False}, "repeated, fresh actors", "vgg9", False),
        ("vgg9", 4, True, {"determinism": False}, "determinism=false", "", False),
        ("vgg9", 4, True, {"resources.tasks_per_actor": 1}, "one task per actor (no fold while training)", "vgg9",
         False),
        ("vgg9", 4, True, {"local.vectorize": True, "local.vectorize_group": 8}, "vectorised", "", False),
        ("vgg9", 4, True, {"local.vectorize": True, "local.vectorize_group": 3}, "vectorised, groups of 3", "", False),
        ("vgg9", 4, True, {"server.partial_sums": 3}, "partial sums of 3 clients on the actors", "", False),
        ("vgg9", 4, True, {"eval.where": "server"}, "eval.where=server (the server's CPU)", "vgg9", True),
        ("vgg9", 0, True, {"resources.num_gpus_per_actor": "auto"}, "num_gpus_per_actor=auto", "", True),
        ("cnn1000", 4, True, VEC250, "vectorised, groups of 250", "vectorised", True),
        ("cnn1000", 2, True, VEC250, "vectorised, groups of 250", "vectorised", False),
        ("cnn1000", 1, True, VEC250, "vectorised, groups of 250", "vectorised", True),
        ("cnn1000", 4, True, {**VEC250, "ray.reuse_workers": False}, "vectorised, groups of 250, repeated",
         "vectorised", False),
        ("cnn1000", 1, True, {"local.vectorize": True, "local.vectorize_group": 1000}, "vectorised, one group", "",
         False),
        ("cnn1000", 4, True, {}, "not vectorised", "", True),
        ("cnn1000", 16, False, VEC250, "vectorised, groups of 250", "", False),
    ]
    out = []
    for wl, actors, gpu, extra, note, same, in_dry in spec:
        if dry:  # a 2-core machine: one row per code path, 1 or 2 actors, no GPU
            if not in_dry:
                continue
            actors, gpu = min(actors, 2), False
        cpus = os.cpu_count() or 1
        overrides = {"resources.num_actors": actors, **extra}
        if extra.get("resources.num_gpus_per_actor") == "auto":  # the count is the packing's (and the CPUs')
            overrides.pop("resources.num_actors")
            label, note = note, ""
        elif gpu:
            overrides["resources.num_gpus_per_actor"] = 1.0 / actors
            label = f"{actors} x {1 / actors:g} GPU"
        else:
            overrides["resources.num_cpus_per_actor"] = min(1.0, cpus / actors)
            label = f"{actors} CPU actor{'s' if actors > 1 else ''}" + (", no GPU" if not dry else "")
        label += f", {note}" if note else ""
        if all(label != r[1] or wl != r[0] for r in out):  # dry: packings that fold into one are run once
            out.append((wl, label, overrides, same))
    return out


VEC250 = {"local.vectorize": True, "local.vectorize_group": 250}
IDENTICAL = {  # identity set -> what it shows
    "per-client": "the per-client path (cnn, 100 clients): a repeat and the packings",
    "vectorised": "the vectorised path (cnn, 1,000 clients, groups of 250): a repeat and the packings",
    "vgg9": "VGG-9 (per client): a repeat",
}


def run_raysim(overrides: dict, out: Path, name: str) -> dict:
    import raysim
    from model_hashes import model_hash

    res = raysim.simulate({**overrides, "output_dir": str(out), "run_name": name}, progress=False)
    m = res.metrics
    steady = m.iloc[1:] if len(m) > 1 else m
    med = {k: float(steady[f"{k}_seconds" if k != "seconds" else k].median())
           for k in ("seconds", "train", "aggregate", "eval")}
    return {**med, "hash": model_hash(res.run_dir / "model.pt"), "accuracy": res.summary.get("final_accuracy"),
            "devices": res.summary.get("client_devices"), "packing": res.summary.get("gpu_packing"),
            "eval_where": res.summary.get("eval_where"), "actors": sum(res.summary["client_actor_nodes"].values())}


def plain_loop(overrides: dict, device: str, rounds: int = 4) -> float:
    """FedAvg's rounds as a plain per-client torch loop in this process, the shards on
    `device`: the median s/round after the first."""
    import numpy as np
    import torch

    from raysim.config import clients_per_round, load_config
    from raysim.experiment import prepare
    from raysim.models import build_model
    from raysim.training import SGD

    cfg = load_config(overrides=[f"{k}={v}" if not isinstance(v, list) else f"{k}=[{','.join(v)}]"
                                 for k, v in overrides.items()])
    data, part, n_classes = prepare(cfg)
    x = data.inputs(data.x_train).to(device)
    y = torch.from_numpy(data.y_train).to(device)
    shards = [torch.from_numpy(np.asarray(ix)).to(device) for ix in part.train]
    torch.manual_seed(0)
    model = build_model(cfg.model, data.input_shape, n_classes).to(device)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    loc, k = cfg.local, clients_per_round(cfg)
    times = []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        chosen = sorted(np.random.default_rng([0, rnd, 1]).choice(int(cfg.num_clients), k, replace=False).tolist())
        acc, total = None, 0
        for cid in chosen:
            model.load_state_dict(glob)
            opt = SGD(model.parameters(), lr=float(loc.lr), momentum=float(loc.momentum))
            gen = torch.Generator().manual_seed(rnd * 100003 + cid)
            xc, yc = x[shards[cid]], y[shards[cid]]
            model.train()
            for _ in range(int(loc.epochs)):
                perm = torch.randperm(len(yc), generator=gen).to(device)
                for s in range(0, len(yc), int(loc.batch_size)):
                    idx = perm[s:s + int(loc.batch_size)]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(xc[idx]), yc[idx]).backward()
                    opt.step()
            sd, n = model.state_dict(), len(yc)
            acc = {kk: v.double() * n for kk, v in sd.items()} if acc is None else \
                {kk: acc[kk] + sd[kk].double() * n if sd[kk].is_floating_point() else sd[kk] for kk in acc}
            total += n
        glob = {kk: (v / total).to(glob[kk].dtype) for kk, v in acc.items()}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU, tiny random data: check that the script works")
    p.add_argument("--data", type=Path, default=ROOT / "runs" / "data" / "mnist-split",
                   help="the MNIST split (python benchmarks/accuracy_mnist.py --write-split DIR)")
    p.add_argument("--out", type=Path, help="results file (default benchmarks/results-gpu-<card>.txt)")
    p.add_argument("--only", help="only the rows whose 'workload: way' matches this regular expression")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not args.dry and not gpu:
        print("benchmarks/gpu.py: no CUDA device here; --dry runs it on the CPU with tiny data", file=sys.stderr)
        return 2
    if not args.dry and not (args.data / "MNIST" / "raw").is_dir():
        print(f"benchmarks/gpu.py: no MNIST split in {args.data}; write it with python benchmarks/accuracy_mnist.py "
              f"--write-split {args.data}", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name(0) if gpu and not args.dry else "cpu-dry"
    out = args.out or HERE / f"results-gpu-{card.lower().replace('nvidia ', '').replace(' ', '-')}.txt"
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)
        out.write_text("\n".join(lines) + "\n")  # as it goes: a killed run keeps what it measured

    say(f"# python benchmarks/gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}   "
        f"({time.strftime('%Y-%m-%d %H:%M')}, {card}, {os.cpu_count()} CPUs, torch {torch.__version__})")
    loads = workloads(args.dry, args.data)
    results: dict[tuple[str, str], dict] = {}
    device = "cuda" if gpu and not args.dry else "cpu"
    t_all = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for wl in [w for w in loads if not args.only or any(re.search(args.only, f"{r[0]}: {r[1]}")
                                                              for r in rows(args.dry) if r[0] == w)]:
            base = {**COMMON, **loads[wl]}
            say(f"== {wl}: " + " ".join(f"{k}={v}" for k, v in loads[wl].items() if k not in ("data_dir",)))
            say(f"   {'way':<52} {'s/round':>8} {'train':>7} {'aggr.':>7} {'aggr.%':>6} {'eval':>6} "
                f"{'+eval%':>6}  sha256[:12]  accuracy  eval on")
            for i, (w, label, extra, same) in enumerate(r for r in rows(args.dry) if r[0] == wl and
                                                        (not args.only or re.search(args.only, f"{r[0]}: {r[1]}"))):
                r = results[(wl, label)] = run_raysim({**base, **extra}, Path(tmp), f"{wl}-{i}")
                r["same"] = same
                whole = r["seconds"] + r["eval"]  # a round with its evaluation
                say(f"   {label:<52} {r['seconds']:8.3f} {r['train']:7.3f} {r['aggregate']:7.3f} "
                    f"{100 * r['aggregate'] / max(r['seconds'], 1e-9):5.1f}% {r['eval']:6.3f} "
                    f"{100 * (r['aggregate'] + r['eval']) / max(whole, 1e-9):5.1f}%  {r['hash'][:12]}  "
                    f"{r['accuracy']:.4f}  {r['eval_where']}")
                if r["packing"]:
                    p_ = r["packing"]
                    say(f"      auto packing: {r['actors']} actors, {p_.get('actors_per_gpu')} per GPU fit, "
                        f"{p_.get('num_gpus_per_actor')} GPU each; measured "
                        + (f"peak {p_['peak_reserved_bytes'] / 2**20:,.0f} MiB reserved ({p_['peak_allocated_bytes'] / 2**20:,.0f}"
                           f" MiB allocated) + {p_['context_bytes'] / 2**20:,.0f} MiB context of "
                           f"{p_['gpu_total_bytes'] / 2**30:.1f} GiB; {p_['probe']}" if p_.get("measured") else "nothing"))
            plain = plain_loop(base, device, rounds=3 if args.dry else 4)
            say(f"   {'plain torch loop, one process, shards on ' + device:<52} {plain:8.3f}")
            best = min(v["seconds"] for (w, _), v in results.items() if w == wl)
            say(f"   fastest raysim way vs the plain loop: {plain / best:.1f}x")
            off = next((k for k in results if k[0] == wl and k[1].endswith("determinism=false")), None)
            on = results.get((wl, off[1].replace(", determinism=false", ""))) if off else None
            off = results.get(off) if off else None
            if on and off:
                say(f"   determinism costs {100 * (on['train'] / off['train'] - 1):+.0f} % of the clients' time "
                    f"({on['train']:.3f} s vs {off['train']:.3f} s; identical bits with it on: see below)")
        say("== bit identity (SHA-256 over model.pt's tensors)")
        ok = True
        for same_set, what in IDENTICAL.items():
            hashes = {label: r["hash"] for (wl, label), r in results.items() if r["same"] == same_set}
            if len(hashes) < 2:
                say(f"   (one run of {what.split(':')[0]}: nothing to compare)")
                continue
            same = len(set(hashes.values())) == 1
            ok &= same
            say(f"   {'identical' if same else 'DIFFERENT'}: {what} "
                f"({', '.join(f'{k}: {v[:12]}' for k, v in hashes.items())})")
        say(f"# {time.time() - t_all:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
