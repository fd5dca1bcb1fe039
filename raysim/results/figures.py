"""Pictures: a partition's per-client label counts (`--show-partition --plot FILE`) and
metric curves of several runs (`python -m raysim.results.plot`). PNG or SVG by the file's suffix."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

FORMATS = (".png", ".svg")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_path(path: Path) -> None:
    from raysim.errors import ConfigError

    if path.suffix.lower() not in FORMATS:
        raise ConfigError(f"--plot {path}: the file must end in .png or .svg")
    if not path.parent.exists():
        raise ConfigError(f"--plot {path}: folder {path.parent} does not exist")


def partition_figure(counts: np.ndarray, path: Path, title: str) -> Path:
    """Top: a heat map of label counts (classes x clients; each client's column scaled to
    its share, so skew is visible whatever the sizes). Bottom: each client's samples as a
    bar stacked by class. Clients beyond 200 are shown as the first 200."""
    plt = _pyplot()
    n_clients, n_classes = counts.shape
    shown = counts[:200]
    shares = shown / np.maximum(shown.sum(1, keepdims=True), 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, min(16.0, 0.08 * len(shown) + 5)), 7),
                                      sharex=True, layout="constrained")
    im = top.imshow(shares.T, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                    extent=(-0.5, len(shown) - 0.5, n_classes - 0.5, -0.5))
    top.set_ylabel("class")
    top.set_title("share of each class in a client's training data", fontsize=9, loc="left")
    fig.colorbar(im, ax=[top, bottom], fraction=0.03, pad=0.01, label="share (top panel)")
    cmap = plt.get_cmap("tab20" if n_classes > 10 else "tab10")
    bottom_acc = np.zeros(len(shown))
    for c in range(n_classes):
        bottom.bar(np.arange(len(shown)), shown[:, c], bottom=bottom_acc, width=1.0,
                   color=cmap(c % cmap.N), label=str(c) if n_classes <= 20 else None)
        bottom_acc += shown[:, c]
    from matplotlib.ticker import MaxNLocator

    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("client" + (f" (first 200 of {n_clients})" if n_clients > 200 else ""))
    bottom.set_ylabel("training samples")
    bottom.set_title("samples per client, stacked by class", fontsize=9, loc="left")
    if n_classes <= 20:
        bottom.legend(title="class", fontsize=7, title_fontsize=7, ncol=n_classes, loc="lower center",
                      bbox_to_anchor=(0.5, 1.08), frameon=False, handlelength=1, columnspacing=0.8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curves_figure(series: list[dict], x_label: str, y_label: str, path: Path, title: Optional[str] = None,
                  columns: int = 1, unit: float = 1.0) -> Path:
    """One line per entry of `series` ({"label", "x", "mean", "low", "high"}), with a band
    between low and high (mean +- std over seeds) where there are several seeds, clipped to
    [0, `unit`] for an accuracy. The legend goes under the axes, long labels wrapped, in
    `columns` columns; past 10 lines the colours repeat with another dash."""
    import textwrap

    plt = _pyplot()
    rows = -(-len(series) // columns)
    fig, ax = plt.subplots(figsize=(7.5 if columns == 1 else 10.0, 4.5 + 0.3 * rows), layout="constrained")
    share = "accuracy" in y_label  # a share: the band stays in [0, unit]
    dashes = ["-", "--", ":", "-."]
    for i, s in enumerate(series):
        (line,) = ax.plot(s["x"], s["mean"], label="\n".join(textwrap.wrap(s["label"], 90)), linewidth=1.5,
                          linestyle=dashes[(i // 10) % len(dashes)])
        if s.get("low") is not None:
            low, high = s["low"], s["high"]
            if share:
                low, high = [max(v, 0.0) for v in low], [min(v, unit) for v in high]
            ax.fill_between(s["x"], low, high, color=line.get_color(), alpha=0.2 if len(series) <= 8 else 0.06,
                            linewidth=0)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncol=columns, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def band_curves(lines: dict[str, list[list[tuple]]], path: Path, title: str, ylabel: str) -> Path:
    """`lines`: label -> each seed's curve [(round, value), ...]. One line per label: the mean
    over the seeds that reached each round, with a band from their min to their max (a run
    that diverged ends where it stopped, and its line with it when it was the last). Up to 8
    labels share one axes; more get a panel each (`small_multiples`)."""
    series = []
    for label, curves in lines.items():
        rounds = sorted({r for c in curves for r, _ in c})
        at = [[v for c in curves for r, v in c if r == x] for x in rounds]
        series.append({"label": label, "x": rounds, "mean": [sum(v) / len(v) for v in at],
                       "low": [min(v) for v in at] if len(curves) > 1 else None,
                       "high": [max(v) for v in at] if len(curves) > 1 else None})
    if len(series) > 8:
        return small_multiples(series, "round", ylabel, path, title=title, unit=100.0)
    return curves_figure(series, "round", ylabel, path, title=title, unit=100.0)


def small_multiples(series: list[dict], x_label: str, y_label: str, path: Path, title: str, unit: float = 1.0,
                    columns: int = 6) -> Path:
    """A panel per entry of `series` (as curves_figure's), all on the same axes' limits, the
    first entry (the baseline) drawn thin and grey in every other panel: past a handful of
    lines one axes cannot show who converges, who diverges and who is still rising."""
    plt = _pyplot()
    rows = -(-len(series) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.3 * columns, 1.9 * rows + 0.6), sharex=True, sharey=True,
                             layout="constrained", squeeze=False)
    base = series[0]
    for i, ax in enumerate(axes.flat):
        if i >= len(series):
            ax.set_visible(False)
            continue
        s = series[i]
        if i:
            ax.plot(base["x"], base["mean"], color="0.6", linewidth=0.8)
        ax.plot(s["x"], s["mean"], color="C0", linewidth=1.3)
        if s.get("low") is not None:
            ax.fill_between(s["x"], [max(v, 0.0) for v in s["low"]], [min(v, unit) for v in s["high"]], color="C0",
                            alpha=0.25, linewidth=0)
        ax.set_title(s["label"], fontsize=8, pad=2)
        ax.set_ylim(0, unit)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel(x_label, fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel(y_label, fontsize=7)
    fig.suptitle(f"{title}; grey: {base['label']}", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
