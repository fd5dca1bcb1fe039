"""What every differential driver here shares (issue 71): raysim's side of a tiny problem, the
batches a raysim client draws (so a reference's client trains on the same ones, in the same
order), and the figures recorded of a model for the suite.

A driver imports a reference checkout's own client and server code (the project ships none:
`--reference PATH` names a checkout, fetched by the user), builds raysim's
`InProcessServer` for the same config, hands both the same initial weights, the same
clients' data and, per client and round, the batches raysim's `local_sgd` draws from the
client's generator, and compares the two models round by round, tensor by tensor.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from raysim.config import load_config
from raysim.testing import InProcessServer


def import_reference(path: str, module: str):
    """The reference's module `module` from the checkout at `path` (its folder first on the path)."""
    root = Path(path).resolve()
    if not (root / f"{module.replace('.', '/')}.py").exists():
        raise SystemExit(f"--reference {path}: no {module}.py there; point it at a checkout of the reference")
    sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module(module)


def raysim_server(overrides: list[str]) -> InProcessServer:
    """raysim's in-process server for `overrides`, set up (its model holds the initial weights)."""
    server = InProcessServer.from_config(load_config(overrides=overrides))
    server.setup()
    return server


def client_batches(server: InProcessServer, rnd: int, cid: int) -> list[list[tuple]]:
    """The batches raysim's `training.local_sgd` trains client `cid` on in round `rnd`, per
    epoch: a permutation of its samples from its generator each epoch, cut in `local.batch_size`
    (the last short batch kept; a batch of one skipped only for a model with BatchNorm, which
    these drivers do not use)."""
    client = server._client(rnd, cid, False)
    loc = server.cfg.local
    n, bs = client.num_samples, int(loc.batch_size)
    epochs = []
    for _ in range(int(client.epochs)):
        perm = torch.randperm(n, generator=client.generator)
        epochs.append([(client.x[perm[s:s + bs]].clone(), client.y[perm[s:s + bs]].clone()) for s in range(0, n, bs)])
    return epochs


class PassBatches:
    """A reference's data loader that reshuffles at every pass, fed raysim's order: each pass
    draws the next permutation of the client's samples from its raysim generator (as
    `local_sgd` does each epoch) and cuts it in batches of `bs`, the last short batch kept.
    Without a generator (a pass outside training, e.g. counting labels): one batch, in order."""

    def __init__(self, x, y, bs: int, generator=None):
        self.x, self.y, self.bs, self.generator = x, y, bs, generator

    def __iter__(self):
        if self.generator is None:
            return iter([(self.x, self.y)])
        perm = torch.randperm(len(self.y), generator=self.generator)
        return iter([(self.x[perm[s:s + self.bs]], self.y[perm[s:s + self.bs]]) for s in range(0, len(self.y), self.bs)])

    def __len__(self):
        return -(-len(self.y) // self.bs)


class EpochLoader:
    """A data loader a reference's training function iterates: the first pass (its accuracy
    before training) and any after the last epoch give all the client's batches of epoch 1;
    passes 2..E+1 give epochs 1..E in raysim's order."""

    def __init__(self, epochs: list[list[tuple]]):
        self.epochs, self.passes = epochs, 0

    def __iter__(self):
        k = self.passes - 1
        self.passes += 1
        return iter(self.epochs[k] if 0 <= k < len(self.epochs) else self.epochs[0])

    def __len__(self):
        return len(self.epochs[0])


def figures(state: dict) -> dict:
    """A model's figures for the suite: each floating tensor's values, flattened (the drivers
    record small models: a few thousand numbers)."""
    return {k: [float(x) for x in v.reshape(-1)] for k, v in state.items() if v.is_floating_point()}


def summary(t: torch.Tensor) -> dict:
    """A large tensor's figures: its sums along the first axis and across it (rows: each
    row's sum; cols: each column's, the rest flattened). Any one changed value moves two of
    them."""
    m = t.detach().double().reshape(t.shape[0], -1) if t.dim() else t.detach().double().reshape(1, 1)
    return {"rows": [float(v) for v in m.sum(1)], "cols": [float(v) for v in m.sum(0)]}


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def worst_key(a: dict, b: dict) -> str:
    """The entry where `a` and `b` differ most."""
    return max((k for k in a if a[k].is_floating_point()), key=lambda k: float((a[k].double() - b[k].double()).abs().max()))


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def write_record(path: str, reference: str, commit: str, overrides: list[str], rounds: list[dict],
                 **extra) -> None:
    """The reference's figures per round, for tests/test_reference_figures.py (`extra`: what
    the test needs to find them in raysim, e.g. the client-state key of a personal part)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"reference": reference, "commit": commit, "overrides": overrides, **extra,
                                      "rounds": rounds}, indent=1) + "\n")


def commit_of(path: str) -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
