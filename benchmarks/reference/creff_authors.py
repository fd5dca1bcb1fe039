"""raysim's CReFF beside its authors' code (shangxinyi/CReFF-FL, main.py: `Local.compute_gradient`,
`Local.local_train`, `Global.initialize_for_model_fusion`, `Global.update_feature_syn`,
`Global.feature_re_train` themselves; the round loop of `CReFF()` restated), round by round
(issue 71, item 8), and raysim's DSA ops beside theirs (Dataset/param_aug.py).

    python benchmarks/reference/creff_authors.py --reference PATH [--record ...] [raysim overrides ...]

PATH is a checkout of shangxinyi/CReFF-FL (the project ships no reference code). What is set
so that the two can match step for step:
- their features are 256 wide (main.py hard-codes `nn.Linear(256, 10)` and `reshape(.., 256)`):
  raysim's model needs `feature_dim` 256 (`model=mlp model_options.hidden=[256]` on digits),
  wrapped for their code as their ResNet's interface (forward -> (features, logits), the
  classifier named `classifier`);
- their DSA reseeds torch from the wall clock (`seed = int(time.time() * 1000) % 100000`):
  off on both sides (`creff.augment=none`, their `--method DC`); the ops themselves are
  checked apart, on the same drawn parameters (`--dsa`);
- their client draws a class's samples with `np.random.permutation`: fed raysim's permutation
  from the client's gradient generator (seed, round, client, 49), the same draws in the same
  order (10 draws, classes ascending within a draw);
- their local training and classifier re-training shuffle with a DataLoader: fed raysim's
  batches (the client's generator; the server's (seed, round, 46)); their crop-and-flip
  transform (CIFAR's 32-pixel crop) is taken out, and their SGD is plain (`local.momentum=0
  local.weight_decay=0`);
- their round-1 v^ is a separate random `nn.Linear`: here the initial model's classifier, as
  raysim's; each round's fresh classifier is torch's default `nn.Linear` initialisation drawn
  after seeding torch with raysim's (seed, round, 45).
Compared each round: the global model (their FedAvg), the federated features and v^.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from harness import PassBatches, commit_of, import_reference, max_difference, raysim_server, summary, write_record  # noqa: E402

from raysim.seeds import seed_for  # noqa: E402


class TheirNet(nn.Module):
    """raysim's encoder and head behind their ResNet_cifar's interface."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.encoder, self.classifier = copy.deepcopy(model.encoder), copy.deepcopy(model.head)

    def forward(self, x):
        f = self.encoder(x)
        return f, self.classifier(f)


def theirs(state: dict) -> dict:
    return {k.replace("head.", "classifier.", 1): v.clone() for k, v in state.items()}


def ours(state: dict) -> dict:
    return {k.replace("classifier.", "head.", 1): v for k, v in state.items()}


class Loader:
    """Their `DataLoader(dataset=..., batch_size=..., shuffle=True)`, called anew each epoch:
    one `PassBatches` over the dataset for all the calls, so each epoch draws the next
    permutation from raysim's generator."""

    def __init__(self, generator: torch.Generator, data=None):
        self.generator, self.data, self.batches = generator, data, None

    def __call__(self, dataset, batch_size, shuffle=False):
        if self.batches is None:
            x, y = self.data if self.data is not None else (dataset.images, dataset.labels)
            self.batches = PassBatches(x, y, int(batch_size), self.generator)
        return self.batches


def permutations(generator: torch.Generator) -> SimpleNamespace:
    """Their `np` as `compute_gradient` uses it: `np.random.permutation(list)` from raysim's generator."""
    def permutation(items):
        return [items[int(i)] for i in torch.randperm(len(items), generator=generator)]

    return SimpleNamespace(random=SimpleNamespace(permutation=permutation))


def run_creff(ref, server, args, rounds: int) -> list[dict]:
    cfg, algo = server.cfg, server.algorithm
    o, seed = cfg.creff, int(cfg.seed)
    glob = object.__new__(ref.Global)  # their server, its state set to raysim's initial one
    glob.device, glob.num_classes, glob.num_of_feature = "cpu", algo.num_classes, int(o.features_per_class)
    glob.feature_syn = algo.features.clone().requires_grad_(True)
    glob.label_syn = algo.labels.clone()
    glob.optimizer_feature = torch.optim.SGD([glob.feature_syn], lr=float(o.feature_lr))
    glob.criterion = nn.CrossEntropyLoss()
    glob.feature_net = nn.Linear(algo.model.feature_dim, algo.num_classes)
    w = theirs(algo.model.state_dict())
    syn_params = {k: v.clone() for k, v in algo.classifier.state_dict().items()}
    numpy, loader, transforms = ref.np, ref.DataLoader, ref.transforms
    ref.transforms = SimpleNamespace(Compose=lambda fs: (lambda x: x), RandomCrop=lambda *a, **k: None,
                                     RandomHorizontalFlip=lambda *a, **k: None)  # their CIFAR crop and flip, out
    out = []
    try:
        for rnd in range(1, rounds + 1):
            syn_feature_params = {**w, "classifier.weight": syn_params["weight"], "classifier.bias": syn_params["bias"]}
            grads, trained, nums = [], [], []
            for c in server.select_clients(rnd):
                x, y = server.data[c]
                local = object.__new__(ref.Local)
                local.data_client = [(x[i], int(y[i])) for i in range(len(y))]
                local.device, local.criterion = "cpu", nn.CrossEntropyLoss()
                local.class_compose = torch.bincount(y, minlength=algo.num_classes).tolist()
                local.local_model = TheirNet(algo.model)
                local.optimizer = torch.optim.SGD(local.local_model.parameters(), lr=float(cfg.local.lr))
                ref.np = permutations(torch.Generator().manual_seed(seed_for(seed, rnd, c, 49)))
                grads.append(copy.deepcopy(local.compute_gradient(copy.deepcopy(syn_feature_params), args)))
                ref.DataLoader = Loader(server._client(rnd, c, False).generator, (x, y))
                trained.append(copy.deepcopy(local.local_train(args, copy.deepcopy(w))))
                nums.append(len(y))
            fedavg = glob.initialize_for_model_fusion(trained, nums)
            glob.update_feature_syn(args, copy.deepcopy(syn_feature_params), grads)
            ref.DataLoader = Loader(torch.Generator().manual_seed(seed_for(seed, rnd, 46)))
            torch.manual_seed(seed_for(seed, rnd, 45))  # raysim's fresh classifier's draw
            syn_params, _ = glob.feature_re_train(copy.deepcopy(fedavg), int(args.batch_size_local_training))
            w = fedavg
            server.round(rnd)
            mine = {"model": ours(w), "features": {"features": glob.feature_syn.detach().clone()},
                    "classifier": syn_params}
            raysim = {"model": algo.model.state_dict(), "features": {"features": algo.features},
                      "classifier": algo.classifier.state_dict()}
            diffs = {k: max_difference(raysim[k], mine[k]) for k in mine}
            print(f"round {rnd}: max |raysim - CReFF| " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()),
                  flush=True)
            out.append({k: {name: summary(t) for name, t in v.items() if t.is_floating_point()} for k, v in mine.items()})
    finally:
        ref.np, ref.DataLoader, ref.transforms = numpy, loader, transforms
    return out


def run_dsa(ref, x: torch.Tensor, seeds: range) -> dict:
    """Each DSA op of theirs (single-op mode, Siamese, seeded) beside raysim's on the same
    drawn parameters: theirs reseed torch before each draw (seed + 1, + 2, ...; seed itself
    picks the op), so raysim's draws are made from generators seeded the same way."""
    from raysim.data import dsa

    param = ref.ParamDiffAug()
    draws, recorded = [0], {}
    uniform, randint = dsa._uniform, dsa._randint

    def reseeded():
        draws[0] += 1
        return torch.Generator().manual_seed(draws[1] + draws[0])

    try:
        dsa._uniform = lambda g, low=0.0, high=1.0: uniform(reseeded(), low, high)
        dsa._randint = lambda g, low, high: randint(reseeded(), low, high)
        worst = 0.0
        for op in dsa.OPS:
            for s in seeds:
                want = ref.DiffAugment(x.clone(), op, seed=s, param=param)
                draws[:] = [0, s]
                got = dsa.AUGMENTS[op](x.clone(), None)
                worst = max(worst, float((got - want).abs().max()))
                recorded[f"{op}/{s}"] = [float(v) for v in want.reshape(-1)]
        print(f"DSA ops ({', '.join(dsa.OPS)}; seeds {seeds.start}-{seeds.stop - 1}): max |raysim - theirs| {worst:.3g}")
    finally:
        dsa._uniform, dsa._randint = uniform, randint
    return recorded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a checkout of shangxinyi/CReFF-FL")
    ap.add_argument("--record", help="write the reference's figures per round to this JSON file")
    ap.add_argument("--dsa", type=int, default=5, help="seeds per DSA op compared (0: none)")
    ap.add_argument("overrides", nargs="*", help="raysim overrides (dataset, model, clients, local.*, creff.*)")
    a = ap.parse_args(argv)
    overrides = ["algorithm=creff", "creff.augment=none", "local.momentum=0", "local.weight_decay=0", *a.overrides]
    server = raysim_server(overrides)
    cfg, algo = server.cfg, server.algorithm
    o = cfg.creff
    if algo.model.feature_dim != 256:
        raise SystemExit(f"their code fixes the features at 256 wide; this model's are {algo.model.feature_dim} "
                         "(model=mlp model_options.hidden=[256])")
    want = {"retrain_start": "fresh", "match_reduction": "sum", "gradient": "sampled", "gradient_draws": 10,
            "augment": "none", "retrain_batch": int(cfg.local.batch_size)}
    bad = [f"creff.{k}={v}" for k, v in want.items() if o[k] != v]
    if bad or float(cfg.local.momentum) or float(cfg.local.weight_decay):
        raise SystemExit(f"their code runs {', '.join(bad) or 'plain SGD (local.momentum=0 local.weight_decay=0)'}")
    ref = import_reference(a.reference, "main")
    ref.args = args = SimpleNamespace(  # what their functions read of args_parser()'s (feature_re_train: the module's)
        num_classes=algo.num_classes, device="cpu", match_epoch=int(o.match_steps), dis_metric="ours",
        crt_epoch=int(o.retrain_epochs), lr_net=float(o.retrain_lr), batch_real=int(o.gradient_batch), dsa=False,
        num_epochs_local_training=int(cfg.local.epochs), batch_size_local_training=int(cfg.local.batch_size))
    torch.set_num_threads(1)
    print(f"CReFF (authors') {commit_of(a.reference)[:12]} vs raysim: {' '.join(overrides)}")
    rounds = run_creff(ref, server, args, int(cfg.rounds))
    aug = import_reference(a.reference, "Dataset.param_aug")
    dsa = run_dsa(aug, server.data[0][0][:3].clone(), range(a.dsa)) if a.dsa else {}
    if a.record:
        write_record(a.record, "shangxinyi/CReFF-FL main.py (Local, Global) and Dataset/param_aug.py",
                     commit_of(a.reference), overrides, rounds, summaries=True, dsa=dsa)
        print(f"recorded: {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
