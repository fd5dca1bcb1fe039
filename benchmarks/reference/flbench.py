"""raysim's Per-FedAvg beside FL-bench's own client code (KarhouTam/FL-bench,
src/client/perfedavg.py `PerFedAvgClient.fit` and `get_data_batch`), round by round (issue 71,
item 8).

    python benchmarks/reference/flbench.py --reference PATH [--variant fo|hf] [--rounds 3] \\
        [--record tests/reference/flbench_perfedavg_fo.json] [raysim overrides ...]

PATH is a checkout of FL-bench (the project ships no reference code; importing it needs
`pynvml`, from the nvidia-ml-py package). FL-bench's client draws its batches one at a time
from its DataLoader's iterator, len(loader) // 2 meta steps an epoch (// 3 for hf), the
iterator carried across epochs; raysim cuts each epoch's permutation into batches of 2 (or 3)
x `local.batch_size`. The two agree batch for batch when every client holds a multiple of 2
(or 3) x the batch size: this driver gives each of its clients such a cut of raysim's
partition of the dataset (the first `--samples` of its samples), and FL-bench's loader
raysim's permutation of them, a new one at every pass. The client object is FL-bench's class,
made without its constructor (which loads FL-bench's datasets) and given what `fit` reads: the
model (raysim's), an inner optimiser (plain SGD at alpha = the round's local.lr, as FL-bench's
default optimiser with no momentum), its `meta_optimizer` (plain SGD at beta), the
cross-entropy, `local_epoch`, and `args.perfedavg` (version, beta, delta). The server step is
FL-bench's FedAvg with Per-FedAvg's client weight 1, restated: the mean of the clients' models
(raysim weighs by samples: the clients here are of one size, so the same).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import PassBatches, commit_of, figures, max_difference, worst_key, write_record  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of KarhouTam/FL-bench")
    ap.add_argument("--variant", choices=("fo", "hf"), default="fo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=128, help="samples per client: a multiple of 2 (fo) or 3 (hf) x batch")
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*)")
    a = ap.parse_args(argv)
    from raysim.config import load_config
    from raysim.testing import InProcessServer

    overrides = ["algorithm=perfedavg", f"perfedavg.variant={a.variant}", "local.momentum=0", "local.weight_decay=0",
                 *a.overrides]
    cfg = load_config(overrides=overrides)
    parts = 2 if a.variant == "fo" else 3
    bs = int(cfg.local.batch_size)
    if a.samples % (parts * bs):
        raise SystemExit(f"--samples must be a multiple of {parts} x local.batch_size = {parts * bs}")
    full = InProcessServer.from_config(cfg)
    short = [c for c, (_, y) in enumerate(full.data) if len(y) < a.samples]
    if short:
        raise SystemExit(f"clients {short} hold fewer than --samples={a.samples} samples: use fewer clients or samples")
    server = InProcessServer(cfg, [(x[:a.samples], y[:a.samples]) for x, y in full.data], full.num_classes, test=full.test)
    server.setup()
    root = Path(a.reference).resolve()
    if not (root / "src" / "client" / "perfedavg.py").exists():
        raise SystemExit(f"--reference {a.reference}: no src/client/perfedavg.py; point it at an FL-bench checkout")
    sys.path.insert(0, str(root))
    from src.client.perfedavg import PerFedAvgClient

    torch.set_num_threads(1)
    beta = float(cfg.local.lr) if cfg.perfedavg.beta is None else float(cfg.perfedavg.beta)
    global_model = copy.deepcopy(server.algorithm.model)
    print(f"FL-bench {commit_of(a.reference)[:12]} vs raysim, perfedavg ({a.variant}): {' '.join(overrides)}; "
          f"{a.samples} samples a client")
    rounds = []
    for rnd in range(1, a.rounds + 1):
        cids = server.select_clients(rnd)
        models = []
        for c in cids:
            client = object.__new__(PerFedAvgClient)
            client.model = copy.deepcopy(global_model)
            client.dataset = SimpleNamespace(train=lambda: None)
            client.trainloader = PassBatches(*server.data[c], bs, server._client(rnd, c, False).generator)
            client.local_epoch = int(cfg.local.epochs)
            client.device = torch.device("cpu")
            client.criterion = torch.nn.CrossEntropyLoss()
            client.optimizer = torch.optim.SGD(client.model.parameters(), lr=float(cfg.local.lr))
            client.meta_optimizer = torch.optim.SGD(client.model.parameters(), lr=beta)
            client.args = SimpleNamespace(perfedavg=SimpleNamespace(version=a.variant, beta=beta,
                                                                    delta=float(cfg.perfedavg.delta)),
                                          optimizer=SimpleNamespace(lr=float(cfg.local.lr)))
            if a.variant == "hf":
                client.model_plus, client.model_minus = copy.deepcopy(client.model), copy.deepcopy(client.model)
            client.fit()
            models.append(client.model.state_dict())
        mean = {k: sum(m[k] for m in models) / len(models) for k in models[0]}  # weight 1 each
        global_model.load_state_dict(mean)
        server.round(rnd)
        ours, theirs = server.algorithm.model.state_dict(), global_model.state_dict()
        print(f"round {rnd}: max |raysim - FL-bench| model {max_difference(ours, theirs):.3g} ({worst_key(ours, theirs)})",
              flush=True)
        rounds.append({"model": figures(theirs)})
    if a.record:
        write_record(a.record, "KarhouTam/FL-bench src/client/perfedavg.py", commit_of(a.reference), overrides, rounds,
                     samples_per_client=a.samples)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
