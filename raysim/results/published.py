"""The published results table (`python -m raysim.results.table --sweep FILE --doc OUT`):
docs/results.md from a sweep over `setting` (labelled variants), `algorithm` and `seed`
(configs/sweeps/results_table.yaml), regenerable by anyone:

- per setting, a row per algorithm: global accuracy (the server's model on the test set,
  final round) and per-client accuracy (each client's test split with the model that
  serves it: its own model for a personalised method, its group's for a clustered one,
  the global model otherwise; the one column every method is comparable on), MiB
  communicated (both ways, whole run), simulated seconds (`system.profile`),
  each "mean +- std over the seeds done"; a cell whose runs are not all there says so;
- each algorithm's row links its config, written in the folder beside the document (OUT
  less `.md`: docs/results.md's is docs/results/; `<side>/<setting>/<algorithm>.yaml`, the run's own config.yaml less where it
  was written): `python -m raysim.run --config THAT seed=0` runs that cell's seed 0;
- `<side>/runs.csv`: every finished run's numbers (what the table shows), its
  `model_sha256` and the processors and torch build that made it (summary.json), so a re-run
  shows the same bits or not; the table is made from it where a run's folder is not here
  (the runs of another machine, or of a session whose folders are gone), and the sweep
  leaves its runs alone (`python -m raysim.sweep --file F --skip-listed runs.csv`): the
  table grows across machines without running anything twice;
- with `<side>/published.yaml`: an opening section setting each cell beside its published
  mean and std, judged by Welch's test (raysim/results/beside.py);
- notes per cell from `<side>/notes.yaml` ({"setting/algorithm": text}, or
  "*/algorithm" for every setting of one algorithm; why a method trails FedAvg there, as
  measured): the cell says "note N", the text is under the tables, one number per text.

Only finished runs are read; nothing runs here (the sweep does that, and resumes)."""
from __future__ import annotations

import csv
import math
import io
import itertools
import json
from pathlib import Path

from raysim.errors import ConfigError
from raysim.results.beside import read_published, section as beside_section
from raysim.results.runs import mean_std
from raysim.results.stats import LEVEL, paired_p

AXES = ("setting", "algorithm", "seed")
WHERE = ("output_dir", "run_name", "resume")  # config keys that say where a run was written, not what it is
PATHS = ("data_dir", "data_store_dir")  # made absolute when the run started: written back as the sweep file gives them


def collect(sweep_file: Path, runs_dir: Path | None = None, recorded: Path | None = None) -> dict:
    """The sweep's plan and its finished runs: {"name", "sweep_dir", "settings", "algorithms",
    "seeds", "points": [{setting, algorithm, seed, dir, record or None}], "skipped": [...]}: a
    point's record from its folder's summary.json where it has one, else its row of
    `recorded` (an earlier runs.csv), else None (not run yet)."""
    from raysim.sweep import _label, folder_name, parse, point_name, read_cells, read_skip, skipped

    name, _, fixed, grid = parse([], sweep_file)
    if set(grid) != set(AXES):
        raise ConfigError(f"sweep file {sweep_file}: the results table needs grid axes {', '.join(AXES)} "
                          f"(got {', '.join(grid)})")
    skip = read_skip(sweep_file, grid)
    sweep_dir = (runs_dir or Path("runs/sweeps")) / folder_name(name, grid)
    label = lambda v: _label(v) or v  # noqa: E731
    rows = read_records(recorded) if recorded is not None else {}
    tuned = _chosen(sweep_dir / "tuning.csv")  # a run here was made with its cell's choice
    points, not_run = [], []
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo))
        point = {k: label(values[k]) for k in AXES}
        if skipped(values, skip):
            not_run.append(point)
            continue
        d = sweep_dir / point_name(values)
        if (d / "summary.json").is_file():
            record = _record(point, json.loads((d / "summary.json").read_text()), d)
            record["tuned"] = tuned.get((str(point.get("setting", "")), str(point["algorithm"])))
        else:
            d, record = None, rows.get(tuple(str(point[k]) for k in AXES))  # its own `tuned`, as recorded
        points.append({**point, "dir": d, "record": record, "method": _method(values["algorithm"])})
    given = {k: json.loads(v) if v[:1] in '"[{' else v for k, v in (o.split("=", 1) for o in fixed) if k in PATHS}
    return {"name": name, "sweep_dir": sweep_dir, "given": given, "settings": [label(v) for v in grid["setting"]],
            "algorithms": [label(v) for v in grid["algorithm"]], "seeds": [label(v) for v in grid["seed"]],
            "points": points, "skipped": not_run, "cells": read_cells(sweep_file, grid)}


def _chosen(path: Path) -> dict:
    """A sweep's tuning.csv (raysim/tuning.py): {(setting, algorithm): the chosen point}."""
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        return {(r["setting"], r["algorithm"]): r["point"] for r in csv.DictReader(f) if r["chosen"] == "1"}


def _cost(tuning_csv: Path, cells: set, table_seconds: float) -> str:
    """The regeneration cost the header states: the tuning runs' time (tuning.csv's wall_seconds, of
    the table's cells) and the table's runs'."""
    rows = []
    if tuning_csv.is_file():
        with tuning_csv.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r["setting"], r["algorithm"]) in cells]
    timed = [float(r["wall_seconds"]) for r in rows if r.get("wall_seconds")]
    untimed = len(rows) - len(timed)
    tuning = sum(timed)
    return (f"Regeneration cost: the tuning's {len(rows)} runs took {tuning / 3600:.1f} h of run time"
            + (f" ({untimed} of them without a recorded time)" if untimed else "")
            + f", the table's runs {table_seconds / 3600:.1f} h: {(tuning + table_seconds) / 3600:.1f} h in all, "
            "in wall time that divided by the points the sweep ran at once (two on a 2-core machine).")


def _merge_tuning(here: Path, recorded: Path) -> None:
    """Keep the sweep's tuning.csv beside runs.csv (`<side>/tuning.csv`): its rows
    replace the recorded ones of the same cells; `python -m raysim.sweep --tuned` reads it on
    another machine."""
    if not here.is_file():
        return
    from raysim.tuning import merge_tuned

    with here.open(newline="") as f:
        merge_tuned(recorded, list(csv.DictReader(f)))


UNMEASURED = "cause not measured"  # a note's words that mark its cell (notes.yaml)


def _method(value) -> str:
    """The algorithm a grid value runs: the value, or a labelled variant's `algorithm=`."""
    if isinstance(value, str):
        return value
    return next(json.loads(o.split("=", 1)[1]) for o in value if o.startswith("algorithm="))


# runs.csv: a row per finished run, what the table shows of it and what its bits depend on
# (the curves, "round:accuracy ..." at every evaluation, global and per client: a steadier column than
# the final round's, a mean of the last few, can be made from them without rerunning anything)
RECORD = ("setting", "algorithm", "seed", "final_accuracy", "final_local_accuracy", "final_personal_accuracy",
          "server_model_unshared", "mib", "sim_seconds", "wall_seconds", "status", "model_sha256",
          "client_processors", "raysim_commit", "config_sha256", "tuned", "accuracy_curve", "per_client_curve",
          "after_training", "mib_curve")
REQUIRED = ("setting", "algorithm", "seed", "final_accuracy", "status", "model_sha256")
ACCURACIES = ("final_accuracy", "final_local_accuracy", "final_personal_accuracy")
NUMBERS = ("final_accuracy", "final_local_accuracy", "final_personal_accuracy", "mib", "sim_seconds", "wall_seconds")


def _record(point: dict, summary: dict, run_dir: Path) -> dict:
    """A finished run's row of runs.csv, from its folder."""
    row = {k: summary.get(k) for k in RECORD if k not in AXES}
    rounds = _metrics(run_dir)
    row["mib"] = (rounds[-1]["bytes_down"] + rounds[-1]["bytes_up"]) / 2 ** 20 if rounds else None
    row["client_processors"] = "; ".join(summary.get("client_processors") or []) or None
    row["accuracy_curve"], row["per_client_curve"] = _curves(rounds)
    row["mib_curve"] = _mib_curve(rounds)
    # a model made after the last round (CCVR's calibration): the run ends with it, and its
    # final_* accuracies are that model's, which no round's evaluation saw
    row["after_training"] = 1 if summary.get("after_training") else None
    return {**{k: point[k] for k in AXES}, **row}


def _metrics(run_dir: Path) -> list[dict]:
    """metrics.parquet's rows, the columns runs.csv takes ([] without the file)."""
    import pyarrow.parquet as pq

    f = run_dir / "metrics.parquet"
    if not f.is_file():
        return []
    names = set(pq.read_schema(f).names)
    wanted = ("round", "accuracy", "personal_accuracy", "local_accuracy", "bytes_down", "bytes_up")
    return pq.read_table(f, columns=[c for c in wanted if c in names]).to_pylist()


def _mib_curve(rows: list[dict]) -> str | None:
    """The MiB sent both ways up to each evaluated round, "round:MiB ..." (a cost claim's
    measure, `mib_to_target`: LG-FedAvg's warm start sends the whole model, then the head)."""
    evaluated = ("accuracy", "personal_accuracy", "local_accuracy")
    points = [f"{r['round']}:{(r['bytes_down'] + r['bytes_up']) / 2 ** 20:.6g}" for r in rows
              if r.get("bytes_down") is not None and any(r.get(k) is not None for k in evaluated)]
    return " ".join(points) or None


def _curves(rows: list[dict]) -> tuple[str | None, str | None]:
    """The accuracy at every evaluation, "round:value ...": the global model's and the
    per-client column's (personal_accuracy, else local_accuracy)."""
    def curve(key: str) -> str | None:
        points = [f"{r['round']}:{r[key]:.4f}" for r in rows if r.get(key) is not None]
        return " ".join(points) or None
    own = curve("personal_accuracy")
    return curve("accuracy"), own if own is not None else curve("local_accuracy")


def read_records(path: Path) -> dict:
    """runs.csv as {(setting, algorithm, seed): row}, numbers as floats (an empty field: None)."""
    if not path.is_file():
        return {}
    rows = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in REQUIRED if k not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{path}: not a results table's runs.csv: no column {', '.join(missing)} "
                              f"(columns: {', '.join(RECORD)})")
        for line, row in enumerate(reader, start=2):
            row = {k: (v if v != "" else None) for k, v in row.items()}
            for k in NUMBERS:
                row[k] = _read_number(row.get(k), path, line, k)
            for k in ("accuracy_curve", "per_client_curve", "mib_curve"):
                _check_curve(row.get(k), path, line, k)
            row["server_model_unshared"] = row.get("server_model_unshared") or None
            rows[(row["setting"], row["algorithm"], row["seed"])] = row
    return rows


def _read_number(text: str | None, path: Path, line: int, key: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{path}, line {line}: {key} {text!r} is not a number") from None
    if key in ACCURACIES and not 0 <= value <= 1:
        raise ConfigError(f"{path}, line {line}: {key} {value} is not an accuracy in [0, 1]")
    return value


def _check_curve(text: str | None, path: Path, line: int, key: str) -> None:
    """A curve is "round:accuracy ..." with whole rounds, rising, and accuracies in [0, 1]
    (`mib_curve`: "round:MiB", MiB a number >= 0)."""
    last, top = 0, math.inf if key == "mib_curve" else 1
    for entry in (text or "").split():
        rnd, _, value = entry.partition(":")
        try:
            ok = int(rnd) > last and 0 <= float(value) <= top
            last = int(rnd)
        except ValueError:
            ok = False
        if not ok:
            what = "round:MiB (a whole round after the one before it, MiB >= 0)" if key == "mib_curve" else \
                "round:accuracy (a whole round after the one before it, an accuracy in [0, 1])"
            raise ConfigError(f"{path}, line {line}: {key} entry {entry!r} is not {what}")


def _cell(values: list, of: int, percent: bool) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    m, s = mean_std([100 * v if percent else v for v in got])
    text = f"{m:.1f} ± {s:.1f}" if percent else f"{m:.4g} ± {s:.2g}"
    return text + (f" ({len(got)}/{of})" if len(got) < of else "")


def write_doc(sweep_file: Path, out: Path, runs_dir: Path | None = None, command: str = "",
              allow_mixed: bool = False, last: int | None = None) -> dict:
    """Write `out` (markdown), its configs, hashes, figures and read its notes; return counts.
    The runs must come from one commit of raysim (`allow_mixed`: the header says they do
    not); a cell's accuracy is the mean of each run's `last` evaluations (default: the sweep's
    tune.last, else 3), its best evaluation beside it, and a diverged run counts as diverged."""
    from omegaconf import OmegaConf

    side = out.with_suffix("")  # docs/results.md -> docs/results/, docs/results/fmnist.md -> docs/results/fmnist/
    rel = side.name  # the document's links into it
    plan = collect(sweep_file, runs_dir, side / "runs.csv")
    if last is None:
        from raysim.sweep import parse, read_tune

        tuning = read_tune(sweep_file, parse([], sweep_file)[3])
        last = tuning.last if tuning is not None else 3
    notes = {}
    if (side / "notes.yaml").is_file():
        notes = OmegaConf.to_container(OmegaConf.load(side / "notes.yaml")) or {}
    wrong = [k for k in notes if str(k).count("/") != 1 or str(k).split("/")[0] not in [*plan["settings"], "*"]
             or str(k).split("/")[1] not in plan["algorithms"]]
    if wrong:  # a misspelt key would drop its note silently
        raise ConfigError(f"{side / 'notes.yaml'}: {wrong[0]!r} names no cell; keys are setting/algorithm or "
                          f"*/algorithm, settings: {', '.join(plan['settings'])}; algorithms: "
                          f"{', '.join(plan['algorithms'])}")
    claims = read_claims(side / "claims.yaml", plan["settings"], plan["algorithms"])
    published = read_published(side / "published.yaml", plan["settings"], plan["algorithms"])
    numbered: dict[str, int] = {}  # note text -> its number, in the order the tables first cite it

    def note(setting: str, algorithm: str) -> str:
        """The cell's note links; "cause not measured" beside one whose text says so (issue 84:
        a note that argues without a run is marked in the cell itself)."""
        keys = [f"{setting}/{algorithm}", f"*/{algorithm}"]
        texts = [str(notes[k]).strip() for k in keys if k in notes]
        return ", ".join(f"[note {numbered.setdefault(t, len(numbered) + 1)}](#note-{numbered[t]})"
                         + (" (cause not measured)" if UNMEASURED in t else "") for t in texts)
    done = [p for p in plan["points"] if p["record"] is not None]
    made_on: dict[str, list] = {}  # processors -> [runs, run seconds]
    for p in done:
        where = made_on.setdefault(p["record"].get("client_processors") or "not recorded", [0, 0.0])
        where[0] += 1
        where[1] += p["record"].get("wall_seconds") or 0.0
    commits: dict[str, int] = {}
    for p in done:
        c = p["record"].get("raysim_commit") or "not recorded"
        commits[c] = commits.get(c, 0) + 1
    code = "; ".join(f"{c} ({n} runs)" for c, n in sorted(commits.items(), key=lambda kv: -kv[1]))
    if len(commits) > 1 and not allow_mixed:
        raise ConfigError(f"the runs come from {len(commits)} versions of raysim: {code}; a table is made from one "
                          "commit's runs: re-run the others at one commit, or pass --allow-mixed (the header then "
                          "says so)")
    side.mkdir(parents=True, exist_ok=True)  # every check passed: now the files beside the document
    _merge_tuning(plan["sweep_dir"] / "tuning.csv", side / "tuning.csv")
    what = "the papers' set-ups beside their published numbers" if published else "every algorithm raysim ships"
    lines = [f"# Results: {what}, {len(plan['settings'])} settings, seeds "
             f"{', '.join(map(str, plan['seeds']))}", "",
             f"Generated by `{command or f'python -m raysim.results.table --sweep {sweep_file} --doc {out}'}` from "
             f"the runs of `python -m raysim.sweep --file {sweep_file} --skip-listed {side / 'runs.csv'}"
             + (f" --tuned {side / 'tuning.csv'}" if (side / "tuning.csv").is_file() else "") +
             f"` ({len(done)} of {len(plan['points'])} runs done; the sweep resumes where it stopped, and on another "
             "machine runs only what runs.csv (and the tuning, tuning.csv) lacks). " + (f"Every run from raysim {code}. " if len(commits) == 1 else
                                         f"**Runs of {len(commits)} versions of raysim** (--allow-mixed): {code}. ") +
             "Each cell: mean ± std over the seeds done (a cell short "
             f"of seeds says how many it has) of each run's accuracy, the mean of its last {last} evaluations "
             "(a method whose model is made after the last round, CCVR's calibration: that model's); "
             "*best*: each run's best evaluation, the same way; *tuned*: the hyper-parameters the sweep's tuning "
             "chose for the row (on held-out training samples of seed 0, never a test set: raysim/tuning.py). "
             "*global*: the server's model on the test set "
             "(† a method whose server model is no client's; ‡ a clustered method's mean of its group models, "
             "which serves only a client not yet in a group); \"N diverged\": N of its runs stopped when their model "
             "went non-finite: they count in no mean, and a cell all of whose runs diverged says only that; "
             "*per client*: each client's own test split with the "
             "model that serves it (a personalised method: the client's own model; a clustered one: its group's; "
             "the others: the global model), the sample-weighted accuracy, the one column every method is "
             "comparable on; *MiB*: both ways, whole run; *sim s*: simulated seconds "
             "(`system.profile`). An algorithm links the config of its row: "
             "`python -m raysim.run --config <that file> seed=0` runs one cell's seed 0, and its summary.json's "
             f"`model_sha256` can be checked against its row of [{rel}/runs.csv]({rel}/runs.csv) (the same "
             "bits on the same torch build and processor). Runs made on: " + "; ".join(
                 f"{where} ({n} run{'s' if n != 1 else ''}, {secs / 3600:.1f} h of run time)"
                 for where, (n, secs) in sorted(made_on.items(), key=lambda kv: -kv[1][0])) + ". "
             + _cost(side / "tuning.csv", {(p["setting"], p["algorithm"]) for p in plan["points"]},
                     sum(secs for _, secs in made_on.values())), ""]
    head = [line[1:].strip() for line in _leading_comments(sweep_file)]
    if head:  # the sweep file's own account of its settings and what was cut to fit
        lines += ["From the sweep file:", "", *[f"> {line}" if line else ">" for line in head], ""]
    index = {(p["setting"], p["algorithm"]): [] for p in plan["points"]}
    for p in plan["points"]:
        index[(p["setting"], p["algorithm"])].append(p)
    if published:
        def runs(setting: str, algorithm: str) -> list:
            out = []
            for p in index.get((setting, algorithm), []):
                if p["record"] is None:
                    continue
                diverged = p["record"].get("status") == "diverged"
                best = _best(p["record"].get("accuracy_curve")) if diverged else _accuracy(p["record"], False, 0)
                out.append({"diverged": diverged, "best": None if best is None else 100 * best,
                            "final": None if diverged else 100 * _accuracy(p["record"], False, 1)})
            return out
        lines += beside_section(published, runs, lambda s, a: len(index.get((s, a), [])), note)
    verdicts = {key: _verdict(claims.get(key[1]), key[0], key[1], index, last) for key in index}
    counted = {v: sum(x.startswith(v) for x in verdicts.values()) for v in ("yes", "no", "undecided", "n/c")}
    lines += [] if not claims else [f"**The papers' claims** (each method's headline comparison, [below](#the-papers-claims)): in "
              f"{counted['yes']} cells the table reproduces its paper's direction, in **{counted['no']} it does not**, "
              f"in {counted['undecided']} its seeds cannot tell (undecided: a paired t-test over the seeds, two-sided "
              f"at {LEVEL}, does not reject equal means), "
              f"{counted['n/c']} are not comparable (another setting or metric), "
              f"{sum(v == '-' for v in verdicts.values())} have no claim of their own (the baselines, the rows that measure a cause) or no runs.", ""]
    unexplained = [f"{s}/{a}" for (s, a), v in sorted(verdicts.items()) if v == "no"
                   and f"{s}/{a}" not in notes and f"*/{a}" not in notes]
    if unexplained:  # every "no" is to carry its fix or measured cause (docs/results/notes.yaml)
        lines += [f"**{len(unexplained)} \"no\" cell(s) without a note yet**: {', '.join(unexplained)}.", ""]
    def also(setting: str, algorithm: str) -> str:
        """The verdict against the claim's second baseline (also_against), beside the first."""
        c = claims.get(algorithm)
        if not c or not c["also_against"] or verdicts[(setting, algorithm)] in ("-", "n/c"):
            return ""
        c = {**c, "judge": "own" if c["judge"] == "both" else c["judge"]}  # a second baseline: the clients' side
        if c["measure"] in TO_TARGET:  # a cost claim against FedAvg; against Local (which sends nothing): accuracy
            c = {**c, "measure": "accuracy", "target": None, "direction": "above"}
        return f"; vs {c['also_against']}: {_verdict(c, setting, algorithm, index, last, c['also_against'])}"
    records = []
    for setting in plan["settings"]:
        picture = _setting_figure(setting, [p for p in plan["points"] if p["setting"] == setting and p["record"]],
                                  plan["algorithms"], side)
        lines += [f"## {setting}", ""] + ([f"![{setting}: accuracy per round]({rel}/{picture})", ""] if picture else [])
        lines += ["| algorithm | tuned | global | best | per client | best | MiB | sim s | paper | note |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for algorithm in plan["algorithms"]:
            cell = index.get((setting, algorithm))
            if cell is None:
                lines.append(f"| {algorithm} | not run | | | | | | | | {note(setting, algorithm)} |")
                continue
            ran = [p for p in cell if p["record"] is not None]
            config = side / setting / f"{algorithm}.yaml"
            here = [p for p in ran if p["dir"] is not None]
            if here:  # from a run here; else the one written when the recorded runs were here
                _write_config(here[0]["dir"], config, plan["given"])
            link = f"[{algorithm}]({rel}/{setting}/{algorithm}.yaml)" if ran and config.is_file() else algorithm
            mark = _global_mark(cell[0]["method"], ran)
            ok = [p for p in ran if p["record"].get("status") != "diverged"]
            diverged = len(ran) - len(ok)
            gone = f"; {diverged} diverged" if diverged else ""
            seeds = len(cell)  # the cell's own seeds: a setting may run fewer (the sweep file's `only`)
            glob = _cell([_accuracy(p["record"], False, last) for p in ok], seeds, True)
            glob_best = _cell([_accuracy(p["record"], False, 0) for p in ok], seeds, True)
            own = _cell([_accuracy(p["record"], True, last) for p in ok], seeds, True)
            own_best = _cell([_accuracy(p["record"], True, 0) for p in ok], seeds, True)
            if ran and not ok:
                glob = own = f"{diverged} diverged"
                glob_best = own_best = "-"
                gone = mark = ""
            mib = _cell([p["record"]["mib"] for p in ran], seeds, False)
            sim = _cell([p["record"]["sim_seconds"] for p in ran], seeds, False)
            tuned = next((p["record"].get("tuned") for p in ran if p["record"].get("tuned")), None) or "-"
            lines.append(f"| {link} | {tuned} | {glob}{mark if glob != '-' else ''}{gone if glob != '-' else ''} | "
                         f"{glob_best} | {own}{gone if own != '-' else ''} | {own_best} | {mib} | {sim} | "
                         f"{_verdict_link(verdicts[(setting, algorithm)], algorithm)}{also(setting, algorithm)} | "
                         f"{note(setting, algorithm)} |")
            records += [p["record"] for p in ran]
        lines.append("")
    ran_seeds = {}  # setting -> the seeds its cells run: a setting may run fewer (the sweep file's `only`)
    for p in plan["points"]:
        ran_seeds.setdefault(p["setting"], set()).add(p["seed"])
    if len({frozenset(s) for s in ran_seeds.values()}) > 1:
        lines += ["Seeds per setting (the sweep file's `only`): " + "; ".join(
            f"{s} {', '.join(str(x) for x in plan['seeds'] if x in ran)}" for s, ran in ran_seeds.items()) + ".", ""]
    left = {}
    for p in plan["skipped"]:
        if (p["setting"], p["algorithm"]) not in index:  # a cell cut only on some seeds runs: said above
            left.setdefault(p["setting"], set()).add(p["algorithm"])
    if left:
        lines += ["Not run (the sweep file's `skip` and `only`: combinations that cannot run, or left out for cost "
                  "as its header says): " + "; ".join(f"on {s}: {', '.join(sorted(a))}" for s, a in left.items()) + ".",
                  ""]
    if plan.get("cells"):  # the sweep file's keys for some cells only: a reader of those rows must know
        where = lambda c: " and ".join(f"{k} {', '.join(sorted(v))}" for k, v in c["where"].items())  # noqa: E731
        lines += ["Set for some cells only (the sweep file's `cells`, each with its reason there): "
                  + "; ".join(f"{where(c)}: {', '.join(o.replace('=', ' = ', 1) for o in c['set'])}"
                              for c in plan["cells"]) + ".", ""]
    if claims:
        lines += ["## The papers' claims", "", "Each method's paper's headline comparison, and the column of this "
                  "table it is read against (*global* or *per client*): a cell says **yes** where the method's mean "
                  "there is above its baseline's in the same setting (below, for a claim that the method trails), "
                  "**no** where it is not (or every run diverged), *undecided at N seeds* where they cannot tell, "
                  f"*n/c* where the claim is about another kind of setting. Decided by a paired t-test over the seeds "
                  f"both cells ran (a seed is the same partition and initial model for both; scipy's ttest_rel), "
                  f"two-sided at {LEVEL}: yes or no only where it rejects equal means. Every \"no\" carries a note with its measured cause or fix.", ""]
        lines += [f'<a id="claim-{a}"></a>**{a}** ({"below" if c["direction"] == "below" else "against"} '
                  f'{c["baseline"]}, {c["judge"]}{_measure(c)}{_where(c["settings"])}): {c["claim"]}\n'
                  for a, c in claims.items()]
    if numbered:
        lines += ["## Notes", "", "Why a cell trails FedAvg's in its setting, or what it must be compared with, as "
                  "measured (\"sweep ... X=Y\": the cell's point with one key changed, `python -m raysim.sweep "
                  f"--file {sweep_file} seed=0 setting=S algorithm=A X=Y --name N`). A note's figures are its own runs', "
                  "made when it was written (the date and processor it starts with); the cells above may come from "
                  f"other runs of the same configs ({rel}/runs.csv), which differ by a run's spread.", ""]
        lines += [f'<a id="note-{n}"></a>**Note {n}.** {text}\n' for text, n in numbered.items()]
    side.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    buf = io.StringIO()
    w = csv.DictWriter(buf, RECORD, lineterminator="\n")
    w.writeheader()
    w.writerows(sorted(records, key=lambda r: (r["setting"], r["algorithm"], str(r["seed"]))))
    (side / "runs.csv").write_text(buf.getvalue())
    return {"runs": len(plan["points"]), "done": len(done)}


MEASURES = ("accuracy", "rounds_to_target", "mib_to_target")
TO_TARGET = ("rounds_to_target", "mib_to_target")


def read_claims(path: Path, settings: list, algorithms: list) -> dict:
    """claims.yaml: {algorithm: {baseline, judge (global | own | both: a claim on the server's
    model and the clients' together, FedRoD's), claim (text: the paper's comparison, its
    numbers, table and page), settings (where comparable; default all; []: none of the
    table's, the claim is about another kind of setting), direction (above, the default: the
    paper has the method above its baseline | below), measure (accuracy, the default |
    rounds_to_target: a speed claim, read as the rounds each run takes to reach `target` times
    the baseline cell's mean accuracy, "below" meaning fewer | mib_to_target: a cost claim, the
    MiB sent until then, from runs.csv's mib_curve), also_against (a second
    baseline whose verdict the cell shows beside: the Local row for personalised methods)}}."""
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    out = {}
    known = {"baseline", "judge", "claim", "settings", "direction", "measure", "target", "also_against"}
    for a, c in raw.items():
        where = f"{path}: {a}"
        if a not in algorithms:
            raise ConfigError(f"{where}: not an algorithm of the table ({', '.join(algorithms)})")
        if not isinstance(c, dict) or not {"baseline", "judge", "claim"} <= set(c):
            raise ConfigError(f"{where}: needs baseline, judge (global | own | both) and claim")
        if set(c) - known:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(set(c) - known))}; allowed: "
                              f"{', '.join(sorted(known))}")
        if c["baseline"] not in algorithms or c["judge"] not in ("global", "own", "both"):
            raise ConfigError(f"{where}: baseline must be an algorithm of the table and judge global, own or both")
        if c.get("also_against") is not None and c["also_against"] not in algorithms:
            raise ConfigError(f"{where}: also_against names {c['also_against']!r}, not an algorithm of the table")
        bad = [x for x in c.get("settings") or [] if x not in settings]
        if bad:
            raise ConfigError(f"{where}: settings names {bad[0]!r}, not one of {', '.join(settings)}")
        if c.get("direction", "above") not in ("above", "below"):
            raise ConfigError(f"{where}: direction must be above or below, not {c['direction']!r}")
        measure = c.get("measure", "accuracy")
        if measure not in MEASURES:
            raise ConfigError(f"{where}: measure must be one of {', '.join(MEASURES)}, not {measure!r}")
        target = c.get("target")
        if (measure in TO_TARGET) != (target is not None) or (
                target is not None and not (isinstance(target, (int, float)) and 0 < target <= 1)):
            raise ConfigError(f"{where}: target (a fraction in (0, 1] of the baseline's accuracy) goes with "
                              f"measure rounds_to_target or mib_to_target, and only with them; got {target!r}")
        out[a] = {"baseline": c["baseline"], "judge": c["judge"], "claim": str(c["claim"]).strip(),
                  "settings": None if c.get("settings") is None else list(c["settings"]),
                  "direction": c.get("direction", "above"), "measure": measure, "target": target,
                  "also_against": c.get("also_against")}
    return out


def _values(points: list, own: bool, last: int) -> dict:
    """{seed: accuracy} of a cell's finished runs (None for a run that diverged)."""
    return {str(p["seed"]): None if p["record"].get("status") == "diverged" else _accuracy(p["record"], own, last)
            for p in points if p["record"] is not None}


def _rounds_to(points: list, own: bool, level: float, mib: bool = False) -> dict:
    """{seed: the first evaluated round whose accuracy reaches `level`} of a cell's finished
    runs (`mib`: the MiB sent up to that round, its mib_curve's); a run that never does: its
    last round plus one evaluation interval (beyond its end; in MiB, the last interval's MiB
    once more); None for a run that diverged or has no curve (no mib_curve: a row of before
    it was recorded)."""
    out = {}
    for p in points:
        if p["record"] is None:
            continue
        text = _own_curve(p["record"]) if own else p["record"].get("accuracy_curve")
        cost = dict(_pairs(p["record"].get("mib_curve"))) if mib else None
        if p["record"].get("status") == "diverged" or not text or (mib and not cost):
            out[str(p["seed"])] = None
            continue
        curve = _pairs(text)
        x = cost if mib else {r: float(r) for r, _ in curve}
        rounds = [r for r, _ in curve if r in x]
        reached = next((r for r, v in curve if v >= level and r in x), None)
        if reached is not None:
            out[str(p["seed"])] = x[reached]
        else:  # beyond the end: one more interval
            out[str(p["seed"])] = (2 * x[rounds[-1]] - x[rounds[-2]]) if len(rounds) > 1 else x[rounds[-1]] + 1
    return out


def _pairs(text: str | None) -> list[tuple[int, float]]:
    """A runs.csv curve ("round:value ...") as [(round, value)], in round order."""
    return [(int(x.split(":")[0]), float(x.split(":")[1])) for x in (text or "").split()]


def _verdict(claim: dict | None, setting: str, algorithm: str, index: dict, last: int,
             baseline: str | None = None) -> str:
    """yes / no / "undecided at N seeds" / n/c for a cell against its paper's claim ('-'
    without a claim or runs), by a paired t-test over the seeds both cells ran without
    diverging (stats.paired_p, two-sided at stats.LEVEL): yes or no where it rejects equal
    means, by the side the mean difference lies on; "no" where every run of the method
    diverged and the baseline's did not. `judge: both`: yes where both columns say yes, no
    where either says no. `baseline`: another than the claim's (its also_against)."""
    if claim is None:
        return "-"
    if claim["settings"] is not None and setting not in claim["settings"]:
        return "n/c"
    baseline = baseline or claim["baseline"]
    mine, base = index.get((setting, algorithm)), index.get((setting, baseline))
    if not mine or not base or all(p["record"] is None for p in mine) or all(p["record"] is None for p in base):
        return "-"
    if claim["judge"] == "both":
        halves = [_verdict({**claim, "judge": j}, setting, algorithm, index, last, baseline) for j in ("global", "own")]
        if "no" in halves:
            return "no"
        return "yes" if halves == ["yes", "yes"] else next(h for h in halves if h != "yes")
    own = claim["judge"] == "own"
    base_acc = _values(base, own, last)
    if claim["measure"] in TO_TARGET:
        got = [v for v in base_acc.values() if v is not None]
        if not got:
            return "-"
        level = claim["target"] * sum(got) / len(got)
        mib = claim["measure"] == "mib_to_target"
        if mib and any(p["record"] is not None and p["record"].get("status") != "diverged"
                       and not p["record"].get("mib_curve") for p in [*mine, *base]):
            return "-"  # a run recorded before runs.csv had bytes per round: nothing to judge on yet
        mine_v, base_v = _rounds_to(mine, own, level, mib), _rounds_to(base, own, level, mib)
    else:
        mine_v, base_v = _values(mine, own, last), base_acc
    mine_v = {s: v for s, v in mine_v.items() if v is not None}
    base_v = {s: v for s, v in base_v.items() if v is not None}
    if not base_v:
        return "-"
    if not mine_v:
        return "no"
    pairs = sorted(set(mine_v) & set(base_v))
    p = paired_p([mine_v[s] for s in pairs], [base_v[s] for s in pairs])
    if p is None or p >= LEVEL:
        return f"undecided at {len(pairs)} seed{'s' if len(pairs) != 1 else ''}"
    above = sum(mine_v[s] - base_v[s] for s in pairs) > 0
    return "yes" if above == (claim["direction"] == "above") else "no"


def _measure(claim: dict) -> str:
    """How a claim is read, beyond accuracy: its speed measure and its second baseline."""
    text = ""
    if claim["measure"] in TO_TARGET:
        unit = "rounds" if claim["measure"] == "rounds_to_target" else "MiB sent"
        text += (f"; {unit} to {100 * claim['target']:g} % of {claim['baseline']}'s accuracy, "
                 f"{'fewer' if claim['direction'] == 'below' else 'more'} claimed")
    if claim["also_against"]:
        text += f"; also against {claim['also_against']}" + (" (on accuracy)" if claim["measure"] in TO_TARGET else "")
    return text


def _where(settings: list | None) -> str:
    if settings is None:
        return ""
    return f"; read on {', '.join(settings)}" if settings else "; no setting of this table is its kind"


def _verdict_link(verdict: str, algorithm: str) -> str:
    return verdict if verdict == "-" else f"[{verdict}](#claim-{algorithm})"


def curve_values(text: str | None) -> list[float]:
    """A runs.csv curve ("round:value ...") as its values, in round order."""
    return [float(x.split(":")[1]) for x in text.split()] if text else []


def _last(text: str | None, k: int) -> float | None:
    values = curve_values(text)
    return sum(values[-k:]) / len(values[-k:]) if values else None


def _best(text: str | None) -> float | None:
    values = curve_values(text)
    return max(values) if values else None


def _accuracy(record: dict, own: bool, last: int) -> float | None:
    """A run's accuracy for a cell: the mean of its last `last` evaluations (0: its best) of
    the global model (`own` False) or of the per-client column (personal, else local
    accuracy); a row without curves: its final value. A run whose model is made after the
    last round (`after_training`: CCVR's calibration) is that model's accuracy (its best: the
    larger of it and the rounds' best)."""
    text = _own_curve(record) if own else record.get("accuracy_curve")
    final = _final(record, own)
    if record.get("after_training") and final is not None:
        return final if last or not text else max(final, _best(text))
    if text:
        return _last(text, last) if last else _best(text)
    return final


def _final(record: dict, own: bool) -> float | None:
    if own:
        personal = record.get("final_personal_accuracy")
        return personal if personal is not None else record.get("final_local_accuracy")
    return record.get("final_accuracy")


def _own_curve(record: dict) -> str | None:
    """The per-client column's curve (personal, else local accuracy); the global one where
    the clients have no test data of their own."""
    return record.get("per_client_curve") or None


def _setting_figure(setting: str, points: list, algorithms: list, side: Path) -> str | None:
    """results/<setting>.png: every algorithm's mean per-client accuracy over rounds (the
    global model's where the clients have no test data) with its seeds' band (min to max);
    a run that diverged ends where it stopped. None without curves."""
    from raysim.results.figures import band_curves

    lines = {}
    for algorithm in algorithms:
        curves = []
        for p in points:
            if p["algorithm"] == algorithm:
                text = _own_curve(p["record"]) or p["record"].get("accuracy_curve")
                if text:
                    curves.append([(int(x.split(":")[0]), 100 * float(x.split(":")[1])) for x in text.split()])
        if curves:
            lines[algorithm] = curves
    if not lines:
        return None
    name = f"{setting}.png"
    band_curves(lines, side / name, title=f"{setting}: per-client accuracy (mean over seeds, band: min-max)",
                ylabel="accuracy (%)")
    return name


def _global_mark(method: str, ran: list) -> str:
    """† the server's model is no client's (`Algorithm.unshared`); ‡ a clustered method
    (several models serve the clients: `Algorithm.serving` overridden), whose "global" model
    is the mean of its group models."""
    from raysim.contract import Algorithm
    from raysim.registry import ALGORITHMS

    if any(p["record"].get("server_model_unshared") for p in ran):
        return " †"
    cls = ALGORITHMS.get(method) if method in ALGORITHMS else None
    return " ‡" if cls is not None and cls.serving is not Algorithm.serving else ""


def _leading_comments(sweep_file: Path) -> list[str]:
    from raysim.config import find_config

    out = []
    for line in Path(find_config(str(sweep_file))).read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line)
    return out


def _write_config(run_dir: Path, to: Path, given: dict) -> None:
    """The run's config.yaml without where it was written and its seed (the command gives
    it), its data paths as the sweep file gives them (relative to where the command runs)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    for key in (*WHERE, "seed"):
        cfg.pop(key, None)
    cfg.update({k: v for k, v in given.items() if k in cfg})
    if isinstance(cfg.get("log"), dict):
        cfg["log"].pop("group", None)
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
