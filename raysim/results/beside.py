"""raysim's cells beside published numbers (issue 83): the section a results document opens
with when `<side>/published.yaml` is there (docs/results/fmnist/published.yaml), made by
`python -m raysim.results.table --sweep F --doc D` with the rest of the document.

published.yaml, one entry per setting of the sweep:

    niid_c2:
      source: NIID-Bench as Flower's baselines/niid_bench reproduces it, its README
      reading: best        # how the source reads a run: best (over the rounds) | final (round)
      seeds: 3             # the runs behind each published mean and std
      numbers: {fedavg: [78.10, 2.51], fedprox: [78.05, 0.99]}   # accuracy %, mean and std
      diverged_at: 10      # optional: a run of raysim's that diverged counts at this accuracy, as the
                           # source's code records one (NaN weights predict one class); else in no mean

Each cell shows raysim's final-round and best-round accuracy (mean ± std over its seeds) and
the published mean ± std, and is judged by the source's own reading: raysim's mean lies within
the published spread when Welch's two-sided t-test (unequal variances, from the two means,
standard deviations and seed counts) does not reject equal means at 0.05. A cell outside it
is to carry a measured note (`<side>/notes.yaml`, as every note of the document)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from raysim.errors import ConfigError
from raysim.results.runs import mean_std
from raysim.results.stats import LEVEL as ALPHA, welch_p

READINGS = ("best", "final")


def read_published(path: Path, settings: list, algorithms: list) -> dict:
    """published.yaml as {setting: {source, reading, seeds, numbers: {algorithm: (mean, std)}}};
    {} without the file. Every name must be the sweep's, every number a percentage."""
    if not path.is_file():
        return {}
    from raysim.config import load_yaml, read_text_file

    raw = load_yaml(read_text_file(str(path), "published numbers"), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must map each setting to its published numbers, not {type(raw).__name__}")
    out = {}
    for setting, entry in raw.items():
        where = f"{path}: {setting}"
        if setting not in settings:
            raise ConfigError(f"{where}: not a setting of the sweep ({', '.join(settings)})")
        if not isinstance(entry, dict) or not {"source", "reading", "seeds", "numbers"} <= set(entry) or \
                set(entry) - {"source", "reading", "seeds", "numbers", "diverged_at"}:
            raise ConfigError(f"{where}: needs source, reading, seeds and numbers (and may have diverged_at)")
        at = entry.get("diverged_at")
        if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at <= 100):
            raise ConfigError(f"{where}: diverged_at must be an accuracy in % (0-100), not {at!r}")
        if entry["reading"] not in READINGS:
            raise ConfigError(f"{where}: reading must be {' or '.join(READINGS)}, not {entry['reading']!r}")
        if not isinstance(entry["seeds"], int) or isinstance(entry["seeds"], bool) or entry["seeds"] < 2:
            raise ConfigError(f"{where}: seeds must be a whole number >= 2 (a spread needs two runs), "
                              f"not {entry['seeds']!r}")
        numbers = {}
        for algorithm, pair in (entry["numbers"] or {}).items():
            if algorithm not in algorithms:
                raise ConfigError(f"{where}: numbers names {algorithm!r}, not an algorithm of the sweep "
                                  f"({', '.join(algorithms)})")
            ok = (isinstance(pair, list) and len(pair) == 2
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)
                  and 0 <= pair[0] <= 100 and pair[1] >= 0)
            if not ok:
                raise ConfigError(f"{where}: {algorithm} must be [mean, std], an accuracy in % (0-100) and a "
                                  f"std >= 0, not {pair!r}")
            numbers[algorithm] = (float(pair[0]), float(pair[1]))
        out[setting] = {"source": str(entry["source"]).strip(), "reading": entry["reading"],
                        "seeds": entry["seeds"], "numbers": numbers,
                        "diverged_at": None if at is None else float(at)}
    return out


def judge(values: list[float], published: tuple[float, float], seeds: int) -> dict:
    """One cell: raysim's run values (%) against a published (mean, std) of `seeds` runs:
    {mean, std, n, p, within}; p and within None with fewer than 2 runs (no spread to test)."""
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "n": 0, "p": None, "within": None}
    m, s = mean_std(values)
    if n < 2:
        return {"mean": m, "std": s, "n": n, "p": None, "within": None}
    p = welch_p(m, s, n, published[0], published[1], seeds)
    return {"mean": m, "std": s, "n": n, "p": p, "within": p >= ALPHA}


def counted(run: dict, reading: str, diverged_at: float | None) -> float | None:
    """One run's accuracy (%) by a reading. A run that diverged: None (in no mean), or, with the
    setting's `diverged_at`, as the source's code records such a run: its final model at that
    accuracy (NaN weights predict one class: chance on a balanced test set), its best the
    larger of that and its best before it diverged."""
    if not run["diverged"]:
        return run[reading]
    if diverged_at is None:
        return None
    return diverged_at if reading == "final" or run["best"] is None else max(run["best"], diverged_at)


def section(published: dict, runs: Callable[[str, str], list], seeds: Callable[[str, str], int],
            note: Callable[[str, str], str]) -> list[str]:
    """The document's opening section: per setting, a row per published number.
    `runs(setting, algorithm)`: raysim's finished runs as {final, best (accuracy %, None where
    the run diverged before any evaluation), diverged}; `seeds(setting, algorithm)`: the seeds the
    sweep runs that cell; `note(setting, algorithm)`: the cell's note links."""
    def shown(got: list, planned: int, reading: str, diverged_at: float | None) -> str:
        values = [counted(r, reading, diverged_at) for r in got]
        kept = [v for v in values if v is not None]
        gone = sum(r["diverged"] for r in got)
        text = "-" if not kept else "{:.1f} ± {:.1f}".format(*mean_std(kept))
        if kept and len(got) < planned:
            text += f" ({len(got)}/{planned})"
        if gone:
            text += f"; {gone} diverged"
            if diverged_at is not None:  # the best reading keeps the run's best before it diverged (`counted`)
                text += f", counted at {'' if reading == 'final' else 'its best before, at least '}{diverged_at:g}"
        return text

    verdicts, unexplained = [], []
    body = []
    for setting, entry in published.items():
        reading, at = entry["reading"], entry["diverged_at"]
        body += [f"### {setting}", "", f"Published: {entry['source']} (mean ± std of {entry['seeds']} runs, each "
                 f"read at its {'best round' if reading == 'best' else 'final round'}).", "",
                 f"| algorithm | raysim, final round | raysim, best round | published ({reading}) | Welch p | "
                 "within | note |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for algorithm, (pm, ps) in entry["numbers"].items():
            got, planned = runs(setting, algorithm), seeds(setting, algorithm)
            values = [v for v in (counted(r, reading, at) for r in got) if v is not None]
            cell = judge(values, (pm, ps), entry["seeds"])
            verdicts.append(cell["within"])
            if cell["within"] is False and not note(setting, algorithm):
                unexplained.append(f"{setting}/{algorithm}")
            within = "-" if cell["within"] is None else "yes" if cell["within"] else "**no**"
            p = "-" if cell["p"] is None else f"{cell['p']:.3f}"
            body.append(f"| {algorithm} | {shown(got, planned, 'final', at)} | {shown(got, planned, 'best', at)} | {pm:.2f} ± {ps:.2f} | "
                        f"{p} | {within} | {note(setting, algorithm)} |")
        body.append("")
    judged = [v for v in verdicts if v is not None]
    head = ["## Beside the published numbers", "",
            f"**{sum(judged)} of {len(judged)} cells** with 2 or more runs lie within the published spread"
            + (f" ({len(verdicts) - len(judged)} of {len(verdicts)} not judged yet: fewer than 2 runs)"
               if len(judged) < len(verdicts) else "") + ". Within: Welch's two-sided t-test from the two means, "
            f"standard deviations and run counts does not reject equal means at {ALPHA} (raysim's runs read as the "
            "source reads its own: final or best round). Every \"no\" carries a note with its measured cause.", ""]
    if unexplained:
        head += [f"**{len(unexplained)} \"no\" cell(s) without a note yet**: {', '.join(unexplained)}.", ""]
    return head + body
