"""Per class of a Fed2 (or any) run's model: is a collapsed class's score shifted, or are its
features gone? (issue 26, Fed2's half-participation dip)

For each model file and each class c it prints: accuracy; accuracy after subtracting every
class's mean logit over the test set (a shift, not a loss of features, comes back here); the
mean of logit c on class-c images and on the rest; the AUC of logit c for "is class c". For a
Fed2 network also the norm of group c's features (what logit c reads) on class c and on the
rest, logit c's classifier row norm and bias, and the AUC of a logistic probe fitted on group
c's features (half of the test set to fit, half to score): below ~0.9 the group has lost the
class, not just its calibration.

    python benchmarks/fed2_group_probe.py RUN_DIR [MODEL.pt ...]   # default: RUN_DIR/model.pt

To probe round by round, run to round R with checkpoint_every=1, copy model.pt, then
`python -m raysim.run resume=RUN_DIR rounds=R+1` and copy again (benchmarks/README.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from raysim.results.analysis import load_run_model


def probe(run: Path, files: list[Path]) -> None:
    for f in files:
        _, data, model = load_run_model(run, [], f)
        x, y = data.inputs(data.x_test), np.asarray(data.y_test)
        k = data.num_classes
        grouped = hasattr(model, "head") and hasattr(model.head, "heads") and len(model.head.heads) == k
        model.eval()
        with torch.no_grad():
            z = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)]).numpy()
            h = torch.cat([model.encoder(x[i:i + 500]) for i in range(0, len(x), 500)]).numpy() if grouped else None
        shifted = (z - z.mean(0, keepdims=True)).argmax(1)
        print(f"== {f}: accuracy {np.mean(z.argmax(1) == y):.3f}, after a per-class mean shift {np.mean(shifted == y):.3f}")
        half = len(y) // 2
        for c in range(k):
            m = y == c
            line = (f"  class {c}: acc {np.mean(z[m].argmax(1) == c):.2f} shifted {np.mean(shifted[m] == c):.2f} | "
                    f"logit on c {z[m, c].mean():6.2f} on rest {z[~m, c].mean():6.2f} | AUC {roc_auc_score(m, z[:, c]):.3f}")
            if grouped:
                hc = h.reshape(len(h), k, -1)[:, c]
                head = model.head.heads[c]
                fit = LogisticRegression(max_iter=2000).fit(hc[:half], m[:half])
                auc = roc_auc_score(m[half:], fit.decision_function(hc[half:]))
                line += (f" | group features |h| on c {np.linalg.norm(hc[m], axis=1).mean():6.2f} on rest "
                         f"{np.linalg.norm(hc[~m], axis=1).mean():6.2f} | row |w| {head.weight.detach().norm():.3f} "
                         f"bias {float(head.bias.detach()):5.2f} | probe AUC {auc:.3f}")
            print(line)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    run_dir = Path(sys.argv[1])
    probe(run_dir, [Path(a) for a in sys.argv[2:]] or [run_dir / "model.pt"])
