"""`python -m raysim.results.analysis RUN_DIR`: what each neuron of a trained model has learned to
prefer, and how much the neurons of each layer disagree (Fed2, Sec. 3.1 and Eq. 17).

For every convolution and fully connected layer of the encoder (a neuron = one output
channel or unit) and every class j: the class-preference entry f_n[j] = mean over test
samples of class j of sum over positions of A_n * dp_j/dA_n, with A_n the layer's output
after its activation (ReLU), and p_j class j's confidence: its logit (default; the softmax
probability saturates on confident samples, p(1 - p) -> 0, and couples every class to
every logit) or, with --confidence softmax, the probability (the model in eval mode).
Entries can be negative (a neuron that is evidence against a class: common under a decoupled
classifier), so strength is |f_n[j]|: a neuron's primary class is argmax_j |f_n[j]|, and a
layer's feature total variance is TV = mean over its neurons of ||u_n - mean u||^2 with
u_n = |f_n| / || |f_n| || (unit vectors, so TV is in [0, 1 - 1/C] and layers of different
scale compare): low where neurons serve all classes alike, high where they specialise --
Fed2 groups the layers from where TV rises. In a grouped (Fed2) network, `aligned` is the share of a layer's
grouped neurons (not silent) whose primary class is one of their group's classes. Neurons
silent on every test sample (dead ReLUs) are counted and left out of TV and `aligned`.

Writes RUN_DIR/analysis/ (or --out): layers.csv (one row per layer), preferences.csv (one
row per neuron) and preferences.png (a heat map per layer, neurons x classes, and TV by
layer); prints the layer table. The model is the run's final model (`model.pt`, its first
model, e.g. "global"), rebuilt by the run's algorithm; the data: the run's dataset
(test split), or `key=value` overrides (e.g. data_dir=...).
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from raysim.errors import ConfigError


def neuron_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, activation module) for each convolution and fully connected layer of the
    encoder, in order: a neuron's activation is the output of the ReLU that follows it."""
    from raysim.models.layered import GroupedLinear

    out, pending = [], None
    for name, m in model.encoder.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear, GroupedLinear)):
            pending = name
        elif isinstance(m, nn.ReLU) and pending is not None:
            out.append((pending, m))
            pending = None
    return out


def class_preferences(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                      per_class: int = 100, confidence: str = "logit") -> dict[str, np.ndarray]:
    """{layer name: (neurons, classes) preference matrix} (module docstring)."""
    model.eval()
    layers = neuron_layers(model)
    out: dict[str, np.ndarray] = {}
    for j in range(num_classes):
        xs = x[y == j][:per_class]
        if len(xs) == 0:
            continue
        acts: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_hook(lambda _m, _i, o, name=name: acts.__setitem__(name, o)) for name, m in layers]
        try:
            scores = model(xs)
            p = (torch.softmax(scores, dim=1) if confidence == "softmax" else scores)[:, j].sum()
            grads = torch.autograd.grad(p, [acts[name] for name, _ in layers])
        finally:
            for h in hooks:
                h.remove()
        for (name, _), g in zip(layers, grads):
            a = acts[name].detach()
            contrib = (a * g).reshape(a.shape[0], a.shape[1], -1).sum(-1)  # (samples, neurons)
            out.setdefault(name, np.zeros((a.shape[1], num_classes)))[:, j] = contrib.mean(0).numpy()
    return out


def unit_strength(pref: np.ndarray) -> np.ndarray:
    """|f_n| / ||f_n||: how strongly each neuron relates to each class, for or against it."""
    strength = np.abs(pref)
    norms = np.linalg.norm(strength, axis=1, keepdims=True)
    return np.divide(strength, norms, out=np.zeros_like(strength), where=norms > 0)


def total_variance(pref: np.ndarray) -> float:
    unit = unit_strength(pref)
    return float(((unit - unit.mean(0)) ** 2).sum(1).mean())


def layer_table(model: nn.Module, prefs: dict[str, np.ndarray]) -> list[dict]:
    groups = model.parameter_groups() if hasattr(model, "parameter_groups") else {}
    class_group = getattr(model, "class_group", None)
    rows = []
    for i, (name, pref) in enumerate(prefs.items()):
        live = np.abs(pref).sum(1) > 0  # a neuron silent on every test sample has no preference
        row = {"layer": i + 1, "module": f"encoder.{name}", "neurons": pref.shape[0], "silent": int((~live).sum()),
               "total_variance": round(total_variance(pref[live]), 4) if live.any() else 0.0, "aligned": ""}
        key = f"encoder.{name}.weight"
        if key in groups and class_group is not None:
            neuron_group = groups[key].numpy()
            if len(neuron_group) != pref.shape[0]:  # GroupedLinear: one row per group, out_g neurons each
                neuron_group = np.repeat(neuron_group, pref.shape[0] // len(neuron_group))
            own = (class_group.numpy()[np.abs(pref).argmax(1)] == neuron_group)[live]
            row["aligned"] = round(float(own.mean()), 3) if own.size else ""
        rows.append(row)
    return rows


def draw(prefs: dict[str, np.ndarray], rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(prefs)
    fig, axes = plt.subplots(n + 1, 1, figsize=(11, 1.3 * n + 3), gridspec_kw={"height_ratios": [1] * n + [2]})
    for ax, (name, pref), row in zip(axes, prefs.items(), rows):
        unit = unit_strength(pref)
        ax.imshow(unit.T, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks([0, pref.shape[1] - 1])
        ax.set_xticks([])
        label = f"layer {row['layer']} ({row['neurons']} neurons, {row['silent']} silent) TV={row['total_variance']:.2f}"
        if row["aligned"] != "":
            label += f" aligned={row['aligned']:.2f}"
        ax.set_ylabel("class", fontsize=7)
        ax.set_title(label, fontsize=8, loc="left")
    axes[0].figure.suptitle(f"{title}\nclass preference of each neuron (columns): |activation x gradient| "
                            f"per class, each column scaled to unit length (yellow: the neuron's classes)", fontsize=9)
    ax = axes[-1]
    ax.bar([r["layer"] for r in rows], [r["total_variance"] for r in rows], color="tab:gray")
    ax.set_xlabel("layer")
    ax.set_ylabel("feature total variance")
    ax.set_xticks([r["layer"] for r in rows])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_run_model(run_dir: Path, overrides: list[str], model_file: Optional[Path] = None):
    """(config, dataset, network) of a finished run: the run's network rebuilt from its
    config.yaml, holding the weights in `model_file` (default: the run's model.pt)."""
    from raysim.config import load_config
    from raysim.data.datasets import load_dataset
    from raysim.registry import ALGORITHMS

    import raysim.algorithms  # noqa: F401  (registration)

    cfg_file, model_file = run_dir / "config.yaml", model_file or run_dir / "model.pt"
    for f in (cfg_file, model_file):
        if not f.is_file():
            raise ConfigError(f"{f} not found: RUN_DIR must be a finished run directory (config.yaml, model.pt)")
    cfg = load_config([str(cfg_file)], overrides)
    data = load_dataset(cfg)
    shape = tuple(data.x_test.shape[1:])
    torch.manual_seed(0)
    model = ALGORITHMS.get(cfg.algorithm)(cfg, data.num_classes, shape).build_model(shape)
    saved = torch.load(model_file, weights_only=True, map_location="cpu")
    state = next((v for v in saved.values() if isinstance(v, dict) and set(v) == set(model.state_dict())), None)
    if state is None:
        raise ConfigError(f"{model_file} holds no model of the run's network ({cfg.algorithm}, {cfg.model})")
    model.load_state_dict(state)
    return cfg, data, model


def analyse(run_dir: Path, overrides: list[str], out: Path, per_class: int, confidence: str = "logit") -> list[dict]:
    cfg, data, model = load_run_model(run_dir, overrides)
    prefs = class_preferences(model, data.inputs(data.x_test), torch.from_numpy(data.y_test),
                              data.num_classes, per_class, confidence)
    rows = layer_table(model, prefs)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "layers.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(out / "preferences.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "neuron", "primary_class", *[f"class_{j}" for j in range(data.num_classes)]])
        for row, pref in zip(rows, prefs.values()):
            for i, v in enumerate(pref):
                w.writerow([row["layer"], i, int(np.abs(v).argmax()), *[f"{a:.6g}" for a in v]])
    draw(prefs, rows, out / "preferences.png", f"{run_dir.name}: {cfg.algorithm}, {cfg.model} on {cfg.dataset}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.results.analysis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("overrides", nargs="*", help="config overrides for the data, e.g. data_dir=...")
    p.add_argument("--out", type=Path, help="output folder (default RUN_DIR/analysis)")
    p.add_argument("--per-class", type=int, default=100, help="test samples per class (default 100)")
    p.add_argument("--confidence", choices=["logit", "softmax"], default="logit",
                   help="what a class's confidence is: its logit (default) or its softmax probability")
    args = p.parse_args(argv)
    try:
        rows = analyse(args.run_dir, args.overrides, args.out or args.run_dir / "analysis", args.per_class,
                       args.confidence)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'layer':>5}  {'module':<24}{'neurons':>8}{'silent':>8}{'total variance':>16}{'aligned':>9}")
    for r in rows:
        print(f"{r['layer']:>5}  {r['module']:<24}{r['neurons']:>8}{r['silent']:>8}{r['total_variance']:>16.3f}"
              f"{str(r['aligned']):>9}")
    print(f"written: {args.out or args.run_dir / 'analysis'}/{{layers.csv,preferences.csv,preferences.png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
