"""A sweep's tuning stage (issue 72): every algorithm tuned the same way, FedAvg included,
before the sweep's own runs (NIID-Bench's and PFLlib's practice, made part of the sweep).

A sweep file's `tune:` section:

    tune:
      seed: 0                   # the seed the choice is made on (the grid's seed axis value)
      validation: 0.2           # eval.validation of the tuning runs: judged on held-out training samples
      last: 3                   # the score: mean of the last 3 evaluations of the judged accuracy
      judge: own                # own: the clients' own accuracy (personal, else local, else global) | global
                                # | balanced: the global model's mean accuracy over the classes (a long-tailed
                                #   validation set judged as a balanced test set is)
      judge_by_setting: {mnist_lt: balanced}
      grid: {local.lr: [0.01, 0.03, 0.1]}                  # every algorithm
      by_algorithm:                                        # label (or name) -> its key hyper-parameter(s)
        fedprox: {fedprox.mu: [0.001, 0.01, 0.1]}          # source in a comment beside it
      otherwise: {local.epochs: [2, 5, 10]}                # the axes of an algorithm by_algorithm does not
                                                           # name, so every method gets as many points
      extend: 1                 # where a choice sits at a numeric axis's edge, one more point past it
                                # (the axis's last ratio), up to this many times per cell

For each (setting, algorithm) of the grid, the tuning points are the product of `grid` and
the algorithm's `by_algorithm` entry (or `otherwise`, where it has none), run at `seed` with `eval.validation`, so that neither
the global test set nor the clients' own test splits take part in the choice
(raysim/data/validation.py). The chosen point (the best score; a diverged or unfinished
tuning run never wins; ties go to the first in the grid's order) is appended to every one of
that cell's runs (all seeds, no validation carve). The scores and the choice are written to
the sweep folder's tuning.csv, which `--tuned CSV` reads back on another machine (its rows
count as finished tuning runs), as runs.csv does for the runs themselves.
"""
from __future__ import annotations

import csv
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from raysim.errors import ConfigError

JUDGES = ("own", "global", "balanced")
CSV_FIELDS = ("setting", "algorithm", "point", "score", "chosen")
WRITTEN_FIELDS = (*CSV_FIELDS, "wall_seconds")  # a run's time: the table's regeneration cost (older files lack it)


@dataclass
class Tuning:
    seed: str = "0"
    validation: float = 0.2
    last: int = 3
    judge: str = "own"
    judge_by_setting: dict = field(default_factory=dict)
    grid: dict = field(default_factory=dict)  # key -> [values]
    by_algorithm: dict = field(default_factory=dict)  # algorithm label -> {key: [values]}
    extend: int = 0  # steps a numeric axis may grow past its edge where the choice sits there (issue 84)
    otherwise: dict = field(default_factory=dict)  # the axes of an algorithm by_algorithm does not name (issue 84)

    def axes(self, algorithm: str) -> dict:
        """key -> [values] tuned for one algorithm: `grid` and its own `by_algorithm` entry,
        else `otherwise` (FedAvg's second axis: every method tuned on as many points)."""
        return {**self.grid, **self.by_algorithm.get(algorithm, self.otherwise)}

    def combos(self, algorithm: str) -> list[list[str]]:
        """The tuning points of one algorithm: lists of overrides, in the grid's order."""
        axes = self.axes(algorithm)
        if not axes:
            return [[]]
        return [[f"{k}={json.dumps(v)}" for k, v in zip(axes, combo)] for combo in itertools.product(*axes.values())]

    def beyond(self, algorithm: str, chosen: list[str], added: list[list[str]]) -> list[list[str]]:
        """The points one step past an edge of a numeric axis where the choice `chosen` sits
        on it (issue 84: 99 of the table's 140 choices were the lr grid's top): that axis's
        value times the ratio of its last two values (or divided, past the first), the other
        axes at the choice; `added`: points already added this way, which widen the axis. An
        axis with a value that is not a positive number (perfedavg.beta's null) never grows."""
        axes = self.axes(algorithm)
        at = {o.split("=", 1)[0]: json.loads(o.split("=", 1)[1]) for o in chosen}
        out = []
        for key, declared in axes.items():
            values = sorted({*declared, *(json.loads(o.split("=", 1)[1]) for c in added for o in c
                                          if o.split("=", 1)[0] == key)}, key=lambda v: (v is None, v or 0))
            if len(values) < 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                          for v in values):
                continue
            if at[key] == values[-1]:
                new = values[-1] * values[-1] / values[-2]
            elif at[key] == values[0]:
                new = values[0] * values[0] / values[1]
            else:
                continue
            if all(isinstance(v, int) for v in declared):  # a count (local.epochs): a whole one, >= 1
                new = max(1, round(new))
                if new in values:
                    continue
            else:
                new = float(f"{new:.6g}")  # 0.1 * 0.1 / 0.03 = 0.33333333333333337 -> 0.333333
            out.append([f"{k}={json.dumps(new if k == key else at[k])}" for k in axes])
        return out

    def judged(self, setting: str) -> str:
        return self.judge_by_setting.get(setting, self.judge)


def read_tuning(spec: dict, where: str, settings: list[str], algorithms: list[str]) -> Tuning | None:
    """The sweep file's `tune:` section (None without one), each key checked."""
    raw = spec.get("tune")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: tune must be a mapping (seed, validation, last, judge, grid, by_algorithm)")
    allowed = {"seed", "validation", "last", "judge", "judge_by_setting", "grid", "by_algorithm", "otherwise", "extend"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: tune has unknown key(s) {', '.join(sorted(unknown))}; allowed: "
                          f"{', '.join(sorted(allowed))}")
    for key in ("judge_by_setting", "grid", "by_algorithm", "otherwise"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ConfigError(f"{where}: tune.{key} must be a mapping, got {raw[key]!r}")
    t = Tuning(seed=str(raw.get("seed", 0)), validation=_number(raw, "validation", 0.2, float, where),
               last=_number(raw, "last", 3, int, where), judge=str(raw.get("judge", "own")),
               judge_by_setting=dict(raw.get("judge_by_setting") or {}),
               grid=dict(raw.get("grid") or {}), by_algorithm=dict(raw.get("by_algorithm") or {}),
               otherwise=dict(raw.get("otherwise") or {}), extend=raw.get("extend", 0))
    if isinstance(t.extend, bool) or not isinstance(t.extend, int) or not 0 <= t.extend <= 3:
        raise ConfigError(f"{where}: tune.extend must be a whole number in 0..3 (steps past a grid's edge), "
                          f"got {t.extend!r}")
    if not 0 < t.validation < 1:
        raise ConfigError(f"{where}: tune.validation must be in (0, 1) (the tuning runs' held-out share), "
                          f"got {t.validation}")
    if t.last < 1:
        raise ConfigError(f"{where}: tune.last must be >= 1 (evaluations averaged), got {t.last}")
    for judge in [t.judge, *t.judge_by_setting.values()]:
        if judge not in JUDGES:
            raise ConfigError(f"{where}: tune judge {judge!r}: allowed {', '.join(JUDGES)}")
    for s in t.judge_by_setting:
        if s not in settings:
            raise ConfigError(f"{where}: tune.judge_by_setting names {s!r}, not a setting ({', '.join(settings)})")
    for a in t.by_algorithm:
        if a not in algorithms:
            raise ConfigError(f"{where}: tune.by_algorithm names {a!r}, not an algorithm of the grid")
    for name, axes in [("grid", t.grid), ("otherwise", t.otherwise),
                       *((f"by_algorithm.{a}", v) for a, v in t.by_algorithm.items())]:
        if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
            raise ConfigError(f"{where}: tune.{name} must be a mapping {{key: [values]}}")
        if len(list(itertools.product(*axes.values()))) > 9:
            raise ConfigError(f"{where}: tune.{name} has more than 9 points; the tuning grid stays small")
    return t


def _number(raw: dict, key: str, default, kind, where: str):
    """tune.`key` as a `kind` (float or int), or one line naming it."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ConfigError(f"{where}: tune.{key} must be {'a number' if kind is float else 'a whole number'}, "
                          f"got {value!r}")
    return kind(value)


def point_suffix(overrides: list[str]) -> str:
    """A tuning point's part of its folder name: lr=0.01,mu=0.1 ('default' for none)."""
    return ",".join(f"{o.split('=', 1)[0].split('.')[-1]}={o.split('=', 1)[1].strip(chr(34))}" for o in overrides) \
        or "default"


def score(run_dir: Path, judge: str, last: int) -> float | None:
    """A tuning run's score: the mean of its last `last` evaluations of the judged accuracy
    (own: personal_accuracy, else local_accuracy, else accuracy; global: accuracy; balanced:
    the global model's per-class accuracy averaged over the classes its test set holds), or of
    the model made after the last round where there is one (CCVR's calibrated model); None
    for a run that diverged, failed or has not finished (it never wins)."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    record = json.loads(summary.read_text())
    if record.get("status") not in (None, "finished"):
        return None
    if record.get("after_training"):  # a model made after the last round (CCVR's calibration) is the result
        return _after_training_score(record, judge)
    import pyarrow.parquet as pq

    table = pq.read_table(run_dir / "metrics.parquet")
    names = table.column_names
    if judge == "balanced":  # the mean over the classes the (validation) test set holds
        counts = record.get("test_class_counts")
        if not any(counts or []) or "per_class_accuracy" not in names:
            return None
        rows = [r for r in table.column("per_class_accuracy").to_pylist() if r is not None]
        values = [held_mean(r, counts) for r in rows]
        return sum(values[-last:]) / len(values[-last:]) if values else None
    order = ["personal_accuracy", "local_accuracy", "accuracy"] if judge == "own" else ["accuracy"]
    for key in order:
        if key in names:
            values = [v for v in table.column(key).to_pylist() if v is not None]
            if values:
                return sum(values[-last:]) / len(values[-last:])
    return None


def held_mean(per_class: list, counts: list | None) -> float | None:
    """Per-class accuracy averaged over the classes the (validation) test set holds."""
    held = [c for c, n in enumerate(counts or []) if n > 0]
    return sum(per_class[c] for c in held) / len(held) if held else None


def _after_training_score(record: dict, judge: str) -> float | None:
    """The score of a run whose reported model is made after its last round (the first of its
    summary's `after_training` models, as the run's final accuracy is): that model's accuracy,
    as the table reads the run; the rounds' evaluations are of another model."""
    if judge == "balanced":
        per_class = next(iter(record["after_training"].values())).get("per_class_accuracy")
        return held_mean(per_class, record.get("test_class_counts")) if per_class else None
    keys = ["final_personal_accuracy", "final_local_accuracy", "final_accuracy"] if judge == "own" else \
        ["final_accuracy"]
    return next((record[k] for k in keys if record.get(k) is not None), None)


def choose(scores: dict[str, float | None]) -> str | None:
    """The best-scoring point (first in order on a tie); None when none scored."""
    scored = [(s, -i, p) for i, (p, s) in enumerate(scores.items()) if s is not None]
    return max(scored)[2] if scored else None


def read_tuned(path: Path) -> dict:
    """A tuning.csv: {(setting, algorithm, point): score or None}."""
    if not path.is_file():
        raise ConfigError(f"--tuned {path}: no such file")
    out = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if set(CSV_FIELDS) - set(reader.fieldnames or []):
            raise ConfigError(f"--tuned {path}: not a tuning.csv (columns {', '.join(CSV_FIELDS)})")
        for line, row in enumerate(reader, start=2):
            try:
                score = float(row["score"]) if row["score"] else None
            except ValueError:
                raise ConfigError(f"--tuned {path}, line {line}: score {row['score']!r} is not a number "
                                  "(a tuning run's score, or empty for one that diverged)") from None
            if score is not None and not 0 <= score <= 1:
                raise ConfigError(f"--tuned {path}, line {line}: score {score} is not an accuracy in [0, 1]")
            out[(row["setting"], row["algorithm"], row["point"])] = score
    return out


def run_seconds(run_dir: Path) -> float | None:
    """A tuning run's wall time from its summary (None when it has none)."""
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()).get("wall_seconds") if summary.is_file() else None


def write_tuned(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=WRITTEN_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in WRITTEN_FIELDS})


def merge_tuned(path: Path, rows: list[dict]) -> None:
    """Write `rows` into the tuning.csv at `path`: they replace the rows of their cells, the
    other cells' rows stay (an earlier invocation's, or another machine's)."""
    cells = {(str(r["setting"]), str(r["algorithm"])) for r in rows}
    kept, before = [], {}
    if path.is_file():
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                before[(r["setting"], r["algorithm"], r["point"])] = r.get("wall_seconds") or None
                if (r["setting"], r["algorithm"]) not in cells:
                    kept.append(r)
    # a point scored from a recorded tuning.csv (made elsewhere) keeps the time recorded with it
    rows = [r if r.get("wall_seconds") is not None else
            {**r, "wall_seconds": before.get((str(r["setting"]), str(r["algorithm"]), str(r["point"])))} for r in rows]
    write_tuned(path, sorted(kept + rows, key=lambda r: (str(r["setting"]), str(r["algorithm"]), str(r["point"]))))


def record(tuning: Tuning, sweep_dir: Path, out: Path) -> int:
    """The tuning runs finished so far in `<sweep_dir>/tuning/` as a tuning.csv at `out` (a cell
    whose every point has finished gets its choice; the others' rows are scores only), so that
    a tuning stage stopped part way counts on another machine (`sweep --tuned out`). `tuning`:
    the sweep file's tune section. Returns the number of rows."""
    cells: dict = {}
    seconds: dict = {}
    for run_dir in sorted((sweep_dir / "tuning").iterdir()) if (sweep_dir / "tuning").is_dir() else []:
        if not (run_dir / "summary.json").is_file():
            continue
        parts = run_dir.name.split(",")
        keys = [i for i, p in enumerate(parts) if p.startswith("algorithm=")]
        if not keys:
            continue
        setting = next((p.split("=", 1)[1] for p in parts if p.startswith("setting=")), "")
        algorithm = parts[keys[0]].split("=", 1)[1]
        point = ",".join(parts[keys[0] + 1:])
        cells.setdefault((setting, algorithm), {})[point] = score(run_dir, tuning.judged(setting), tuning.last)
        seconds[(setting, algorithm, point)] = run_seconds(run_dir)
    rows = []
    for (setting, algorithm), scores in sorted(cells.items()):
        complete = len(scores) >= len(tuning.combos(algorithm))  # points past an edge (extend) come on top
        best = choose(scores) if complete else None
        rows += [{"setting": setting, "algorithm": algorithm, "point": p, "score": s, "chosen": int(p == best),
                  "wall_seconds": seconds[(setting, algorithm, p)]} for p, s in scores.items()]
    write_tuned(out, rows)
    return len(rows)
