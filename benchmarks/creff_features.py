"""How good are CReFF's federated features? At the end of a CReFF run, re-train the classifier
on other feature sets from the same state and compare their test accuracy (issues 26, 45).

    python benchmarks/creff_features.py RUN_DIR [--match-steps 2000]

RUN_DIR is a finished `algorithm=creff` run (its model.pt holds the global model, the
re-trained classifier and the federated features). Rows: the FedAvg model's own classifier
and the run's re-trained one v^, as they are; then, from the global feature extractor u, a
classifier re-trained the way the run re-trains (`creff.retrain_start`, `retrain_epochs`,
`retrain_lr`, `retrain_batch`: CReFF.retrain itself) on:
  - the run's federated features as they are (and from the aggregated classifier instead;
    and scaled to the real features' mean norm, a probe of whether their scale is what
    misleads the classifier: CReFF's cosine matching leaves the scale free), and after `--match-steps` more matching steps against the clients' exact per-class
    gradients of this state (all clients);
  - CCVR's virtual features: 100 draws per class from the Gaussians pooled over every
    client's per-class mean and covariance, and over the first 8 clients only;
  - 100 real training features per class (a balanced draw): what a perfect matching could give.
Prints test accuracy, per-class accuracy, and the mean L2 norm of each feature set (the real
features' for comparison).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raysim.algorithms.ccvr import pooled_gaussians  # noqa: E402
from raysim.algorithms.creff import CReFF, linear_ce_gradients, matching_loss  # noqa: E402
from raysim.experiment import prepare  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--match-steps", type=int, default=2000)
    args = p.parse_args()
    cfg = OmegaConf.load(args.run_dir / "config.yaml")
    data, part, C = prepare(cfg)
    model = CReFF(cfg, C, data.input_shape).build_model(data.input_shape)
    state = torch.load(args.run_dir / "model.pt", weights_only=False)
    model.load_state_dict(state["global"])
    model.eval()
    v_hat = copy.deepcopy(model.head)
    v_hat.load_state_dict(state["classifier"])
    y, yt = torch.as_tensor(data.y_train), torch.as_tensor(data.y_test)
    with torch.no_grad():
        f, ft = model.encoder(data.inputs(data.x_train)), model.encoder(data.inputs(data.x_test))
    m = int(cfg.creff.features_per_class)

    algo = CReFF(cfg, C, data.input_shape)
    algo.model = model

    def show(name: str, head) -> None:
        with torch.no_grad():
            pred = head(ft).argmax(1)
        per_class = [float((pred[yt == c] == c).float().mean()) for c in range(C)]
        print(f"{name:56s} accuracy {float((pred == yt).float().mean()):.4f}  per class "
              + " ".join(f"{a:.2f}" for a in per_class))

    def report(name: str, feats: torch.Tensor, labels: torch.Tensor, start: str | None = None) -> None:
        """A classifier re-trained on (feats, labels) the way the run re-trains (CReFF.retrain)."""
        algo.features, algo.labels = feats, labels
        if start is not None:
            algo.cfg = OmegaConf.merge(cfg, {"creff": {"retrain_start": start}})
        algo.retrain(int(cfg.rounds))
        algo.cfg = cfg
        show(f"{name} (norm {float(feats.norm(dim=1).mean()):.1f})", algo.classifier)

    print(f"training samples per class: {np.bincount(data.y_train, minlength=C).tolist()}")
    print(f"re-training: start {cfg.creff.retrain_start}, {cfg.creff.retrain_epochs} epochs, lr {cfg.creff.retrain_lr}, "
          f"batch {cfg.creff.retrain_batch}; real training features' mean norm {float(f.norm(dim=1).mean()):.1f}")
    show("FedAvg's classifier (the global model's)", model.head)
    show("the run's re-trained classifier v^", v_hat)
    labels = torch.arange(C).repeat_interleave(m)
    report("federated features (the run's)", state["features"], labels)
    report("federated features, from the aggregated classifier", state["features"], labels, "aggregated")
    scale = float(f.norm(dim=1).mean() / state["features"].norm(dim=1).mean())
    report(f"federated features x {scale:.2f} (a probe: to the real features' mean norm)", state["features"] * scale,
           labels)

    # the clients' per-class gradients w.r.t. v^ at this state, averaged over the holders
    w, b = v_hat.weight.detach(), v_hat.bias.detach()
    per_class: dict[int, list] = {}
    for idx in part.train:
        idx = torch.as_tensor(np.asarray(idx))
        for c in torch.unique(y[idx]).tolist():
            gw, gb = linear_ce_gradients(w, b, f[idx][y[idx] == c][None], torch.tensor([c]))
            per_class.setdefault(c, []).append((gw[0], gb[0]))
    classes = sorted(per_class)
    tw = torch.stack([torch.stack([g for g, _ in per_class[c]]).mean(0) for c in classes])
    tb = torch.stack([torch.stack([g for _, g in per_class[c]]).mean(0) for c in classes])
    feats = state["features"].reshape(C, m, -1)[classes].clone().requires_grad_(True)
    target = torch.as_tensor(classes)
    for _ in range(args.match_steps):
        fw, fb = linear_ce_gradients(w, b, feats, target)
        loss = sum(matching_loss((fw[k], fb[k]), (tw[k], tb[k]), cfg.creff.match_reduction) for k in range(len(classes)))
        (g,) = torch.autograd.grad(loss, [feats])
        with torch.no_grad():
            feats -= float(cfg.creff.feature_lr) * g
    matched = torch.zeros(C, m, f.shape[1])
    matched[classes] = feats.detach()
    report(f"federated features + {args.match_steps} steps (loss {float(loss.detach()) / len(classes):.3f}/class)",
           matched.reshape(C * m, -1), labels)

    def stats_of(clients) -> list[dict]:
        out = []
        for idx in clients:
            idx = torch.as_tensor(np.asarray(idx))
            d = {}
            for c in torch.unique(y[idx]).tolist():
                fc = f[idx][y[idx] == c].double()
                cov = torch.cov(fc.T) if len(fc) > 1 else torch.zeros(fc.shape[1], fc.shape[1], dtype=torch.float64)
                d[c] = (len(fc), fc.mean(0), cov)
            out.append(d)
        return out

    for name, clients in (("every client", part.train), ("the first 8 clients", part.train[:8])):
        gaussians = pooled_gaussians(stats_of(clients), f.shape[1])
        rng = np.random.default_rng(0)
        xv = np.concatenate([rng.multivariate_normal(mu, cov, m, method="eigh") for mu, cov in gaussians.values()])
        report(f"CCVR's virtual features ({name})", torch.as_tensor(xv, dtype=torch.float32),
               torch.as_tensor(np.repeat(list(gaussians), m)))
    g = torch.Generator().manual_seed(0)
    real = torch.cat([torch.nonzero(y == c).flatten()[torch.randint(0, int((y == c).sum()), (m,), generator=g)]
                      for c in range(C)])
    report(f"{m} real training features per class", f[real], y[real])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
