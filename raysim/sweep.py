"""`python -m raysim.sweep`: one experiment over a grid of config values.

    python -m raysim.sweep seed=0,1,2 algorithm=fedavg,fedprox rounds=20 --name fedprox-check
    python -m raysim.sweep --file configs/sweeps/fed2_ablation_digits.yaml

A key with comma-separated values (outside [...]) is a grid axis, one value a fixed
override (or, for an axis of the sweep file, that axis cut to one value: `seed=0`); a sweep
file says the same in YAML:

    name: fedprox-check         # the sweep directory: <output_dir>/<name>
    config: [configs/experiments/niid_bench_mnist_c2.yaml]   # --config files for every point
    fixed: {rounds: 20}
    grid: {seed: [0, 1, 2], algorithm: [fedavg, fedprox]}
    skip: [{seed: 2, algorithm: fedprox}]   # grid points not to run (a combination that cannot)
    only: [{seed: 1, algorithm: [fedavg]}]  # where seed is 1, only these algorithms run (the rest skipped)

A grid value that is a mapping is a set of overrides taken together, for axes whose values
are not one key (`variant: [{algorithm: fed2}, {algorithm: fedavg, model_options.norm: group}]`).
Its `label`, if it has one, names it: the point's folder says `setting=mnist_c2`, and
`setting=mnist_c2` on the command line runs that variant alone (configs/sweeps/results_table.yaml).
A one-value key on the command line wins over a variant's own value for it (`setting=mnist_c2
model=vgg9` runs the VGG; a sweep file's `fixed` yields to the variant).

Every point is a normal run directory inside the sweep directory (named by its grid
values), written by the same code as `python -m raysim.run`; `python -m raysim.results.table` and
`python -m raysim.results.plot` read them. Every point's config is checked before the first one
starts. Points that ask for Ray (`resources.num_actors`, `ray.address`, faults) run as Ray
Tune trials, on the local Ray or the cluster of `ray.address`: several at once when
`resources.num_actors` is set and the cluster's CPUs hold that many actors per point more
than once, else one after another. Otherwise the points run one after another in the
sweep's own process, each as `python -m raysim.run` runs it (a small one with no Ray at all);
with `--processes N` (or `processes: N` in the sweep file; auto: one per CPU) N at a time in
processes of this machine, each point's clients in its own process (raysim/sweep_pool.py). Rerunning a sweep
skips the points that finished; a point that was interrupted resumes from its checkpoint
(or starts again if it wrote none). `--skip-listed CSV` leaves out the points a CSV lists by
its grid-axis columns: a results table's runs.csv, the runs another machine made and
recorded, so a sweep too long for one machine's session grows across sessions.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from raysim.errors import ConfigError, NothingToDo, RunDiverged, StartFailed, WriteFailed
from raysim.tuning import point_suffix


def split_values(text: str) -> list[str]:
    """'0,1,[2,3]' -> ['0', '1', '[2,3]']: commas inside brackets stay."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{" and 1 or (-1 if ch in "]}" else 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def parse(args_overrides: list[str], file: Path | None) -> tuple[str | None, list[str], list[str], dict]:
    """(name, config files, fixed overrides, grid {key: [value strings]})."""
    name, files, fixed, grid = None, [], [], {}
    if file is not None:
        from raysim.config import find_config, load_yaml, read_text_file

        try:
            file = Path(find_config(str(file)))  # configs/sweeps/x.yaml: the shipped file from any directory
        except ConfigError:
            raise ConfigError(f"sweep file {file} not found") from None
        spec = load_yaml(read_text_file(str(file), "sweep file"), str(file))
        if spec is not None and not isinstance(spec, dict):
            raise ConfigError(f"sweep file {file} must hold a mapping (name, config, fixed, grid), not "
                              f"{type(spec).__name__}")
        unknown = set(spec or {}) - {"name", "config", "fixed", "grid", "skip", "only", "cells", "tune", "processes"}
        if unknown:
            raise ConfigError(f"sweep file {file}: unknown key(s) {', '.join(sorted(unknown))}; allowed: name, config, "
                              f"fixed, grid, skip, only, cells, tune, processes")
        spec = spec or {}
        name = spec.get("name")
        files = spec.get("config") or []
        files = [files] if isinstance(files, str) else files
        for key, ok, form in (("name", name is None or isinstance(name, str), "a folder name"),
                              ("config", isinstance(files, list) and all(isinstance(f, str) for f in files),
                               "a config file or a list of them"),
                              ("fixed", isinstance(spec.get("fixed") or {}, dict), "a mapping {key: value}"),
                              ("grid", isinstance(spec.get("grid") or {}, dict), "a mapping {key: [values]}")):
            if not ok:
                raise ConfigError(f"sweep file {file}: {key} must be {form}, got {spec[key]!r:.80}")
        fixed = _dotted(spec.get("fixed") or {})
        for k, values in (spec.get("grid") or {}).items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"sweep file {file}: grid.{k} must be a non-empty list of values")
            # a value that is a mapping is a set of overrides taken together (an axis of variants)
            grid[k] = [_variant(v, f"sweep file {file}: grid.{k}") if isinstance(v, dict) else
                       v if isinstance(v, str) else json.dumps(v) for v in values]
    given = []  # the command line's one-value keys: they win over a grid value's own keys
    for o in args_overrides:
        if "=" not in o:
            raise ConfigError(f"{o!r} is not key=value (a grid axis is key=v1,v2,...)")
        key, value = o.split("=", 1)
        values = split_values(value)
        axis = grid.get(key, [])
        if any(_label(v) is not None for v in axis):  # labelled variants: the command line picks by label (or value)
            labels = {_label(v) or v: v for v in axis if _label(v) is not None or isinstance(v, str)}
            unknown = [v for v in values if v not in labels]
            if unknown:
                raise ConfigError(f"{key}={unknown[0]}: not a label of grid.{key}; its labels: {', '.join(labels)}")
            grid[key] = [labels[v] for v in values]
        elif len(values) > 1 or key in grid:  # on the command line, an axis of the file is replaced
            grid[key] = values
        else:
            fixed.append(o)
            given.append(key)
    for key, values in grid.items():  # `setting=mnist_c2 model=vgg9`: the variant's model= yields
        grid[key] = [[v for v in value if not _sets(v, given)] if isinstance(value, list) else value
                     for value in values]
    if not grid:
        raise ConfigError("no grid: give at least one key with several values (seed=0,1,2) or a sweep file's grid")
    return name, files, fixed, grid


def _sets(override: str, keys: list[str]) -> bool:
    """Whether `override` (key=value) sets one of `keys` or a key inside one of them."""
    k = override.split("=", 1)[0]
    return not override.startswith(LABEL) and any(k == g or k.startswith(g + ".") for g in keys)


def _dotted(node: dict, prefix: str = "") -> list[str]:
    """{"local": {"lr": 0.1}} -> ["local.lr=0.1"]: overrides that set keys, not whole sections."""
    out = []
    for k, v in node.items():
        out += _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={json.dumps(v)}"]
    return out


LABEL = "#label="  # a variant's label, kept first in its list of overrides (not an override)


def _variant(mapping: dict, where: str) -> list[str]:
    """A grid value that is a mapping: its overrides, after its `label` (if it has one), which
    names the point's folder (`setting=mnist_c2`) and picks it on the command line."""
    mapping = dict(mapping)
    label = mapping.pop("label", None)
    if label is not None and (not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", label)):
        raise ConfigError(f"{where}: label {label!r} must be a plain name (letters, digits, . _ -)")
    return ([LABEL + label] if label is not None else []) + _dotted(mapping)


def _label(value) -> str | None:
    return value[0][len(LABEL):] if isinstance(value, list) and value and value[0].startswith(LABEL) else None


def _overrides(key: str, value) -> list[str]:
    return [o for o in value if not o.startswith(LABEL)] if isinstance(value, list) else [f"{key}={value}"]


def _shown(key: str, value) -> str:
    if _label(value) is not None:  # a labelled variant: setting=mnist_c2
        return f"{key.split('.')[-1]}={_label(value)}"
    if isinstance(value, list):  # a variant: its first value, then key=value: fed2+norm=batch
        parts = [o.split("=", 1) for o in value]
        shown = [parts[0][1].strip('"')] + [f"{k.split('.')[-1]}={v.strip(chr(34))}" for k, v in parts[1:]]
        return key.split(".")[-1] + "=" + "+".join(shown)
    return f"{key.split('.')[-1]}={value}"


def _spec(file: Path) -> dict:
    """The sweep file's mapping, read again (`parse` checked its shape) for one section."""
    from raysim.config import find_config, load_yaml, read_text_file

    path = find_config(str(file))
    return load_yaml(read_text_file(path, "sweep file"), path) or {}


def _entries_reader(file: Path):
    """The sweep file's mapping, its grid's value names per axis, and `check(section, axis,
    values)`, which refuses an axis or a value the grid does not have (skip, only, cells)."""
    spec = _spec(file)
    axes = spec.get("grid") or {}
    names = {k: [str(x.get("label")) if isinstance(x, dict) else str(x) for x in v] for k, v in axes.items()}

    def check(section: str, k: str, values: list):
        if k not in axes:
            raise ConfigError(f"sweep file {file}: {section} names {k!r}, not a grid axis ({', '.join(axes)})")
        for v in values:
            if str(v) not in names[k]:
                whose = section + ("'" if section.endswith("s") else "'s")
                raise ConfigError(f"sweep file {file}: {whose} {k}={v} is none of grid.{k}'s values or labels")

    return spec, names, check


def read_skip(file: Path | None, grid: dict) -> list[dict]:
    """The sweep file's `skip`: grid points not to run, each a mapping {axis: value or
    label} (`{setting: synthetic, algorithm: fed2}`: a combination that cannot run)."""
    if file is None:
        return []
    spec, names, check = _entries_reader(file)
    skip = spec.get("skip") or []
    if not isinstance(skip, list) or not all(isinstance(x, dict) and x for x in skip):
        raise ConfigError(f"sweep file {file}: skip must be a list of mappings {{axis: value}}, got {skip!r:.80}")
    for entry in skip:
        for k, v in entry.items():
            check("skip", k, [v])
    return skip + _only_as_skip(spec.get("only"), names, check, file)


def read_cells(file: Path | None, grid: dict, given: list[str] = ()) -> list[dict]:
    """The sweep file's `cells`: keys set for some cells only, each entry the cells it names
    ({axis: value or [values], ...}, as `only` names them) and `set: {key: value}`
    (`{setting: mnist_c2, algorithm: [fedconcat, fedconcat_id], set: {fedconcat.encoder_rounds: 93}}`:
    an option that only those algorithms read, at a value only that setting's rounds allow).
    Returned as [{"where": {axis: {labels}}, "set": [overrides]}]; `given` (keys of the command
    line's one-value overrides) win over a cell's own, as over a grid value's."""
    if file is None:
        return []
    spec, _, check = _entries_reader(file)
    entries = spec.get("cells") or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("set"), dict) and e["set"]
                                                and len(e) > 1 for e in entries):
        raise ConfigError(f"sweep file {file}: cells must be a list of mappings {{axis: value or [values], ..., "
                          f"set: {{key: value}}}}, got {entries!r:.80}")
    out = []
    for entry in entries:
        where = {k: [str(x) for x in (v if isinstance(v, list) else [v])] for k, v in entry.items() if k != "set"}
        for k, values in where.items():
            check("cells", k, values)
        out.append({"where": {k: set(v) for k, v in where.items()},
                    "set": [o for o in _dotted(entry["set"]) if o.split("=", 1)[0] not in given]})
    return out


def _in_cell(values: dict, cell: dict) -> bool:
    """Whether the point of these grid values is one a `cells` entry names."""
    return all(str(_label(values[k]) or values[k]) in labels for k, labels in cell["where"].items())


def cell_overrides(values: dict, cells: list[dict]) -> list[str]:
    """The overrides the sweep file's `cells` give the point of these grid values."""
    return [o for c in cells if _in_cell(values, c) for o in c["set"]]


def _only_as_skip(only, names: dict, check, file) -> list[dict]:
    """The sweep file's `only`: entries {axis: value, ..., one axis: [values]}, "where the
    scalar axes take these values, run only the listed values of the list axis" (a setting
    run for a few algorithms), as the skip entries of every value left out."""
    if only is None:
        return []
    per_entry = [[k for k, v in e.items() if isinstance(v, list)] for e in only] if isinstance(only, list) and all(
        isinstance(e, dict) for e in only) else None
    lists = [e[0] for e in per_entry] if per_entry is not None and all(len(e) == 1 for e in per_entry) else None
    if lists is None:
        raise ConfigError(f"sweep file {file}: only must be a list of mappings {{axis: value, ..., axis: [values]}} "
                          f"with one list each, got {only!r:.80}")
    out = []
    for entry, axis in zip(only, lists):
        where = {k: v for k, v in entry.items() if k != axis}
        for k, v in where.items():
            check("only", k, [v])
        check("only", axis, entry[axis])
        kept = {str(v) for v in entry[axis]}
        out += [{**where, axis: v} for v in names[axis] if v not in kept]
    return out


def read_tune(file: Path | None, grid: dict):
    """The sweep file's `tune:` section (raysim/tuning.py), or None."""
    if file is None:
        return None
    from raysim.tuning import read_tuning

    spec = _spec(file)
    if spec.get("tune") is None:
        return None
    if "algorithm" not in grid or "seed" not in grid:
        raise ConfigError(f"sweep file {file}: tune needs grid axes algorithm and seed (it tunes each algorithm on "
                          "one seed)")
    labels = lambda axis: [_label(v) or v for v in grid.get(axis, [])]  # noqa: E731

    def in_file(axis: str) -> list[str]:  # the file's own values: the command line may have cut the axis
        return [str(v.get("label", v.get(axis))) if isinstance(v, dict) else str(v)
                for v in (spec.get("grid") or {}).get(axis) or []] or labels(axis)
    tuning = read_tuning(spec, f"sweep file {file}", in_file("setting"), in_file("algorithm"))
    if tuning.seed not in labels("seed"):
        raise ConfigError(f"sweep file {file}: tune.seed={tuning.seed} is not a value of grid.seed")
    return tuning


def read_processes(file: Path | None) -> int:
    """The sweep file's `processes` (sweep_pool.py): 1 when it has none."""
    from raysim.sweep_pool import processes_wanted

    if file is None:
        return 1
    return processes_wanted(_spec(file).get("processes"), f"sweep file {file}: processes")


def read_listed(path: Path, grid: dict) -> list[dict]:
    """`--skip-listed FILE`: a CSV whose columns include grid axes (a results table's
    runs.csv); each row names a point not to run here (done on another machine, its result
    kept in the file): {axis: value or label} for the axes it has, as `skip`'s entries."""
    import csv

    if not path.is_file():
        raise ConfigError(f"--skip-listed {path}: no such file")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        axes = [k for k in (reader.fieldnames or []) if k in grid]
        if not axes:
            raise ConfigError(f"--skip-listed {path}: no column names a grid axis ({', '.join(grid)}); its columns: "
                              f"{', '.join(reader.fieldnames or []) or 'none'}")
        return [{k: row[k] for k in axes} for row in reader]


def folder_name(name: str | None, grid: dict) -> str:
    """The sweep's folder name: the file's `name`, else made from the grid keys."""
    return name or "-".join(k.split(".")[-1] for k in grid)


def skipped(values: dict, skip: list[dict]) -> bool:
    return any(all(str(v) == (_label(values[k]) or values[k]) for k, v in entry.items()) for entry in skip)


def value_label(key: str, value) -> str:
    """How a grid value is named: its label, the value itself, or (an unlabelled variant) as
    its folder names it."""
    return _label(value) or (value if isinstance(value, str) else _shown(key, value))


def point_name(values: dict) -> str:
    text = ",".join(_shown(k, v) for k, v in values.items())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def plan(files, fixed, grid, sweep_dir: Path, skip: list[dict] = (), extra=None, check: bool = True,
         per_cell: list[dict] = ()) -> list[dict]:
    """Every point (less those `skip` names): its name, overrides and state (done / partial /
    new); each point's config checked here, before anything runs. `per_cell` (read_cells): keys
    set for some points only. `extra(values)`: overrides appended to a point's (its tuned
    hyper-parameters). `check` (or `check(values)`): a point's
    folder from an earlier run must hold this config's run (`check_same_point`); off for the
    plan made before the tuning stage, whose points lack their tuned values still, and for a
    finished cell whose tuned values are not known (its tuning runs gone)."""
    from raysim.config import read_layers, resolve
    from raysim.config.layers import asks_for_ray

    points = []
    unchecked = list(per_cell)  # a `cells` entry whose points are all skipped is checked too, on one of them
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo))
        if skipped(values, skip):
            if any(_in_cell(values, c) for c in unchecked):
                cell = next(c for c in unchecked if _in_cell(values, c))
                unchecked.remove(cell)
                try:
                    resolve(read_layers(files, [*fixed, *(o for k, v in values.items() for o in _overrides(k, v)),
                                                *cell["set"]]))
                except ConfigError as e:
                    raise ConfigError(f"cells entry setting {', '.join(cell['set'])} (its points all skipped): "
                                      f"{e}") from None
            continue
        unchecked = [c for c in unchecked if not _in_cell(values, c)]
        name = point_name(values)
        run_dir = sweep_dir / name
        overrides = [*fixed, *(o for k, v in values.items() for o in _overrides(k, v)), *cell_overrides(values, per_cell),
                     *(extra(values) if extra else []), f"output_dir={sweep_dir}", f"run_name={name}"]
        if not any(o.split("=", 1)[0] == "log.group" for o in fixed) and "log.group" not in grid:
            overrides.append(f"log.group={sweep_dir.name}")  # trackers group the sweep's runs (runtime/trackers.py)
        # a summary means the run ended (finished, or diverged: a result too, not retried)
        state = "done" if (run_dir / "summary.json").is_file() else "partial" if run_dir.exists() else "new"
        try:  # every check that needs no data (the run directory's own state is this sweep's business)
            cfg = resolve(read_layers(files, overrides))
        except ConfigError as e:
            raise ConfigError(f"point {name}: {e}") from None
        if state != "new" and (check(values) if callable(check) else check):
            check_same_point(run_dir, cfg, name, state)
        if any(p["name"] == name for p in points):
            raise ConfigError(f"two grid points share the folder name {name!r}: give the variants different values")
        points.append({"name": name, "overrides": overrides, "state": state, "run_dir": str(run_dir),
                       "actors": cfg.resources.num_actors, "cpus": cfg.resources.num_cpus_per_actor,
                       "needs_ray": asks_for_ray(cfg.resources, cfg.faults, cfg.ray),
                       "values": {k: value_label(k, v) for k, v in values.items()}})
    return points


def plan_tuning(files, fixed, grid, sweep_dir: Path, tuning, cells: set, skip: list[dict] = (),
                per_cell: list[dict] = (), added: dict | None = None) -> list[dict]:
    """The tuning points (raysim/tuning.py) of the (setting, algorithm) `cells`: each at
    tune.seed, judged on held-out training samples, in `<sweep>/tuning/`; `added`: {cell:
    [combo]}, points past a grid's edge (tune.extend) on top of the grid's."""
    at_seed = {**grid, "seed": [v for v in grid["seed"] if (_label(v) or v) == tuning.seed]}
    out = []
    for p in plan(files, fixed, at_seed, sweep_dir / "tuning", skip=skip, per_cell=per_cell):
        cell = (p["values"].get("setting", ""), p["values"]["algorithm"])
        if cell not in cells:
            continue
        base = [o for o in p["overrides"] if o.split("=", 1)[0] not in ("output_dir", "run_name")]
        for combo in [*tuning.combos(cell[1]), *(added or {}).get(cell, [])]:
            name = f"{p['name']},{point_suffix(combo)}"
            overrides = [*base, *combo, f"eval.validation={tuning.validation}", f"output_dir={sweep_dir / 'tuning'}",
                         f"run_name={name}"]
            run_dir = sweep_dir / "tuning" / name
            state = "done" if (run_dir / "summary.json").is_file() else "partial" if run_dir.exists() else "new"
            from raysim.config import read_layers, resolve

            try:
                cfg = resolve(read_layers(files, overrides))
            except ConfigError as e:
                raise ConfigError(f"tuning point {name}: {e}") from None
            if state != "new":
                check_same_point(run_dir, cfg, name, state)
            out.append({**p, "name": name, "overrides": overrides, "state": state, "run_dir": str(run_dir),
                        "cell": cell, "combo": combo, "point": point_suffix(combo)})
    return out


def check_same_point(run_dir: Path, cfg, name: str, state: str) -> None:
    """A point's folder from an earlier run of the sweep counts (done, or resumed when
    partial) only if that run computed what this point asks for: its config.yaml must agree
    with the point's config on every key that decides the result, `rounds` included.
    Otherwise the sweep is refused: reporting another config's results as this one's is
    the one thing a sweep must never do."""
    from raysim.config import read_yaml, record_diff, run_record

    saved = run_dir / "config.yaml"
    if not saved.is_file():  # a folder with no config: a point that stopped before it wrote anything
        return
    from omegaconf import OmegaConf

    data = read_yaml(str(saved))
    record = run_record(OmegaConf.create(data))
    diff = record_diff(record, cfg) + (["rounds"] if data.get("rounds") != cfg.rounds else [])
    if diff:
        record["rounds"] = data.get("rounds")
        now = dict(run_record(cfg), rounds=cfg.rounds)
        first = diff[0]
        more = f" and {len(diff) - 1} more ({', '.join(diff[1:4])}{', ...' if len(diff) > 4 else ''})" if len(diff) > 1 else ""
        what = "finished" if state == "done" else "unfinished"
        raise ConfigError(f"point {name}: {run_dir} holds a {what} run of another config ({first} was "
                          f"{record.get(first)!r}, is {now.get(first)!r}{more}); give the sweep another --name or "
                          "--output-dir, or remove that folder")


def run_point(point: dict, files: list, cwd: str, servers=None) -> dict:
    """One point's run (a Tune trial's, or one of `run_here`'s on `servers`), as `python -m
    raysim.run` would do it, resumed from its checkpoint when an earlier attempt left one."""
    from raysim.launch import check, launch

    os.chdir(cwd)  # Tune starts trials in their own folder; the sweep's paths are the caller's
    run_dir = Path(point["run_dir"])
    overrides = point["overrides"]
    if run_dir.exists():
        if (run_dir / "checkpoint.pt").is_file():
            # where it runs may change (config/record.py's RESUMABLE_KEYS): the sweep's resources (its
            # server threads; sweep_pool's no-Ray start)
            overrides = [f"resume={run_dir}", *(o for o in overrides if o.startswith("resources."))]
            files = []
        else:
            shutil.rmtree(run_dir)  # nothing to resume: start the point again
    layers, cfg = check(files, overrides)
    summary = launch(layers, cfg, time.time(), progress=False, server_name=f"raysim-server.{point['name']}",
                     servers=servers)
    return {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}


def point_result(point: dict, files: list, cwd: str, servers=None) -> dict:
    """What a trial reports: the point's summary, or, for bad input the server finds (a
    partition that leaves a client empty), a diverged run or a failure in an algorithm's
    code, `raysim_error` (said in one line by `sweep`): raised, it would have Tune print its
    own traceback."""
    from raysim.launch import RunFailed, ServerDied

    try:
        return run_point(point, files, cwd, servers)
    except NothingToDo:  # the point finished since the sweep was planned: its summary is the result
        summary = json.loads((Path(point["run_dir"]) / "summary.json").read_text())
        return {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}
    except (ConfigError, RunDiverged, RunFailed, ServerDied, WriteFailed) as e:
        return {"raysim_error": f"{type(e).__name__}: {e}"}


def _trial(params: dict) -> None:
    from ray import tune

    tune.report(point_result(params["point"], params["files"], params["cwd"]))


def concurrency(points: list[dict]) -> int:
    """How many points at once: the cluster's CPUs over a point's actors, when they are fixed."""
    import ray

    if any(p["actors"] is None for p in points):  # actors per CPU share: a point takes the whole cluster
        return 1
    need = [p["actors"] * (p["cpus"] or 1) for p in points]
    return max(1, int(ray.cluster_resources().get("CPU", 1) // max(need)))


def server_threads(points: list[dict], at_once: int) -> int:
    """A point's server's torch threads: the CPUs each of the `at_once` points gets, less its
    client actors' (at least 1). Left at every CPU, servers running at once on busy cores spin
    in torch's thread pool (measured on CReFF's server steps: 45x slower on 2 cores)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = max((p["actors"] or 0) * (p["cpus"] or 1) for p in points)
    return max(1, cpus // max(1, at_once) - int(actors))


def sweep(files: list, fixed: list, grid: dict, name: str, output_dir: Path, say=print, skip: list = (),
          tuning=None, tuned: dict | None = None, per_cell: list = (), processes: int = 1) -> Path:
    """Run the sweep's points not done; with a `tune:` section (`tuning`), first the tuning
    points of every cell that still has a point to run, then those points with each cell's
    chosen hyper-parameters (raysim/tuning.py). `tuned`: recorded tuning scores (--tuned).
    `processes` > 1: the points in that many processes of this machine, no Ray (sweep_pool.py)."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's reporter then keeps to verbose=0 (no tables)
    from raysim.run_lock import RunLock, check_free

    sweep_dir = (output_dir / name).resolve()
    if sweep_dir.is_dir():  # another sweep running into the same folder would run (and remove) the same points
        check_free(sweep_dir)
    # every point's config checked before anything runs; with a tuning stage, a finished point's folder is
    # checked against its config with the tuned values, in the plan made after the stage
    points = plan(files, fixed, grid, sweep_dir, skip, check=tuning is None, per_cell=per_cell)
    todo = [p for p in points if p["state"] != "done"]
    if not todo:
        say(f"sweep {sweep_dir}: {len(points)} points, {len(points)} done, 0 to run")
        return sweep_dir
    if processes > 1:  # the tuning points are the same configs with other hyper-parameters
        from raysim.sweep_pool import check as check_processes

        check_processes(todo, processes)
    cell_of = lambda v: (v.get("setting", ""), v["algorithm"])  # noqa: E731
    if tuning is not None:  # the tuning points' configs checked too before the folder is made
        plan_tuning(files, fixed, grid, sweep_dir, tuning, {cell_of(p["values"]) for p in todo}, skip, per_cell)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(sweep_dir):
        if tuning is not None:
            cells = {cell_of(p["values"]) for p in todo}
            finished = {cell_of(p["values"]) for p in points} - cells
            chosen = _tune(files, fixed, grid, sweep_dir, tuning, cells, tuned or {}, say, skip, finished, per_cell,
                           processes)
            labelled = lambda v: cell_of({k: value_label(k, x) for k, x in v.items()})  # noqa: E731
            # a finished cell's points are checked with its tuned values (its choice read back from its
            # tuning runs), not with the defaults; one whose tuning runs are gone is not checked
            points = plan(files, fixed, grid, sweep_dir, skip, extra=lambda v: chosen.get(labelled(v), []),
                          check=lambda v: labelled(v) in chosen, per_cell=per_cell)
            todo = [p for p in points if p["state"] != "done"]
        say(f"sweep {sweep_dir}: {len(points)} points, {len(points) - len(todo)} done, {len(todo)} to run")
        return _run(points, todo, files, fixed, sweep_dir, say, processes=processes)


def _tune(files, fixed, grid, sweep_dir: Path, tuning, cells: set, tuned: dict, say, skip: list = (),
          finished: set = frozenset(), per_cell: list = (), processes: int = 1) -> dict:
    """The tuning stage: run the tuning points of `cells` not done nor recorded, score every one,
    write <sweep>/tuning.csv; returns {cell: the chosen point's overrides}, the `finished` cells'
    (every point run) too where their tuning runs are all there, read back, nothing run."""
    from raysim.tuning import choose, merge_tuned, run_seconds, score

    recorded = lambda p: (*p["cell"], p["point"]) in tuned  # noqa: E731
    there = lambda p: recorded(p) or (Path(p["run_dir"]) / "summary.json").is_file()  # noqa: E731
    scored = lambda p: tuned[(*p["cell"], p["point"])] if recorded(p) else \
        score(Path(p["run_dir"]), tuning.judged(p["cell"][0]), tuning.last)  # noqa: E731
    added: dict = {}  # points past a grid's edge, derived from finished scores, so a resumed sweep finds them again
    for step in range(tuning.extend + 1):
        tpoints = plan_tuning(files, fixed, grid, sweep_dir, tuning, cells | finished, skip, per_cell, added)
        todo = [p for p in tpoints if p["cell"] in cells and p["state"] != "done" and not recorded(p)]
        say(f"tuning{f' (past a grid edge, step {step})' if step else ''}: "
            f"{sum(p['cell'] in cells for p in tpoints)} points for {len(cells)} cell(s) on seed {tuning.seed}, "
            f"{len(todo)} to run")
        if todo:
            _run(tpoints, todo, files, fixed, sweep_dir / "tuning", say, done=there, processes=processes)
        if step == tuning.extend:
            break
        grew = False
        for cell in sorted(cells | finished):
            mine = [p for p in tpoints if p["cell"] == cell]
            if not mine or not all(map(there, mine)):
                continue
            best = choose({p["point"]: scored(p) for p in mine})
            if best is None:
                continue
            known = {p["point"] for p in mine}
            new = [c for c in tuning.beyond(cell[1], next(p["combo"] for p in mine if p["point"] == best),
                                            added.get(cell, [])) if point_suffix(c) not in known]
            if new:
                added.setdefault(cell, []).extend(new)
                grew = True
        if not grew:
            break
    rows, chosen = [], {}
    for cell in sorted(cells | finished):
        mine = [p for p in tpoints if p["cell"] == cell]
        if cell not in cells and not all(map(there, mine)):
            continue  # a finished cell whose tuning runs are gone: its choice is not known here
        scores = {p["point"]: scored(p) for p in mine}
        best = choose(scores)
        if best is None and cell not in cells:
            continue
        if best is None:
            raise ConfigError(f"tuning {'/'.join(c for c in cell if c)}: every tuning run diverged or failed "
                              f"({', '.join(scores)}); widen tune.grid")
        chosen[cell] = next(p["combo"] for p in mine if p["point"] == best)
        took = {p["point"]: run_seconds(Path(p["run_dir"])) for p in mine}  # None for a point recorded elsewhere
        rows += [{"setting": cell[0], "algorithm": cell[1], "point": p, "score": s, "chosen": int(p == best),
                  "wall_seconds": took[p]} for p, s in scores.items()]
        if cell in cells:
            say(f"tuning {'/'.join(c for c in cell if c)}: {best} "
                f"({', '.join(f'{p} {s:.4f}' if s is not None else f'{p} -' for p, s in scores.items())})")
    merge_tuned(sweep_dir / "tuning.csv", rows)
    return chosen


def _run(points: list, todo: list, files: list, fixed: list, sweep_dir: Path, say, done=None,
         processes: int = 1) -> Path:
    """Run the points not done (the sweep's folder is locked meanwhile): in `processes`
    processes when more than one (sweep_pool.py), one after another in this process when
    none asks for Ray (`run_here`), else on Ray Tune (`run_on_tune`).
    `done(point)`: whether a point counts as done afterwards (default: it wrote a summary)."""
    if processes > 1:
        from raysim.sweep_pool import run_in_processes

        ended = run_in_processes(todo, files, say, processes)
    elif all(p["needs_ray"] is None for p in todo):
        ended = run_here(todo, files, say)
    else:
        ended = run_on_tune(todo, files, say, sweep_dir)
    failed = [(p, why) for p, why in ended if why is not None]
    diverged = [(p, why) for p, why in failed if _diverged(Path(p["run_dir"]))]
    for p, _ in diverged:  # a run that diverged ended: its summary is its result (a tuning point's: never chosen)
        say(f"point {p['name']} diverged: kept as its result")
    failed = [f for f in failed if f not in diverged]
    for p, why in failed:
        say(f"point {p['name']} failed: {why.splitlines()[0][:300]}")
    done = sum(done(p) if done else (Path(p["run_dir"]) / "summary.json").is_file() for p in points)
    if failed:
        raise ConfigError(f"{len(failed)} of {len(todo)} points failed (above); rerun the sweep to retry them")
    if done < len(points):  # stopped (Ctrl-C, SIGTERM) before every point ran
        raise SweepInterrupted(f"sweep interrupted: {done} of {len(points)} points done; rerun the same command "
                               "to finish (finished points are kept, unfinished ones resume from their checkpoint)")
    return sweep_dir


def run_here(todo: list, files: list, say) -> list:
    """The points one after another in this process, each as `python -m raysim.run` runs it
    (raysim/launch.py): a point whose clients train in under `resources.ray_start_s` trains
    them here, with no Ray (runtime/here.py), a longer one starts a local Ray for its client
    actors, which the later points reuse (runtime/pool.py). Taken when no point asks for Ray
    (`config.layers.asks_for_ray`: no `ray.address`, `resources.num_actors`, faults, dashboard),
    when Tune would run them one at a time too (`concurrency`): a small sweep then costs its
    points' seconds, not Ray's, Tune's and each trial's processes' start-up (a 3-point sweep
    of 2-round digits runs: 47 s on Tune, ~6 s here, on 2 cores). Same bits either way.
    Ctrl-C or SIGTERM stop the point in hand at its last checkpoint (`launch.Interrupted`),
    as a run's; returns [(point, why it failed or None)] of the points that ran."""
    import signal
    import threading

    from raysim.config import load_config
    from raysim.launch import HereServers, Interrupted
    from raysim.runtime.ray_session import start_ray

    def ray_running() -> bool:
        return "ray" in sys.modules and sys.modules["ray"].is_initialized()

    def start_later(point):  # a point's server asks for Ray after its data, when Ray would pay (runtime/here.py)
        def start(info, say) -> None:
            nonlocal started
            start_ray(load_config(files, point["overrides"]).ray, say, command=True)
            started = True
        return start

    say(f"running {len(todo)} point(s) one after another in this process (no point asks for Ray: each trains "
        "its clients here, or on a local Ray when that pays)")
    main_thread = threading.current_thread() is threading.main_thread()
    term = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    started, ended = False, []
    try:
        for p in todo:  # the server in this process, as the command's; on a caller's Ray, the session's
            servers = (HereServers() if started else None if ray_running()  # (launch.SessionServers, kept ones)
                       else HereServers(start_ray=start_later(p)))
            ended.append((p, point_result(p, files, os.getcwd(), servers=servers).get("raysim_error")))
    except (KeyboardInterrupt, Interrupted):
        pass  # the point in hand kept its last checkpoint; `_run` counts what is done
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, term)
        if started:  # the caller finds its process as it was
            import ray

            from raysim.runtime import pool

            ray.shutdown()
            pool.forget()
    return ended


def run_on_tune(todo: list, files: list, say, sweep_dir: Path) -> list:
    """The points as Ray Tune trials, on the local Ray or the cluster of `ray.address`,
    `concurrency` at a time; returns [(point, why it failed or None)]."""
    from ray import tune

    from raysim.config import load_config
    from raysim.runtime.ray_session import start_ray

    # Ray's settings from a point's config: the fixed keys alone may set a section (heterofl.*)
    # that only the grid's algorithm reads, and would be refused without it
    start_ray(load_config(files, todo[0]["overrides"]).ray, command=True)
    from raysim.runtime import pool

    pool.release()  # an earlier run's kept processes (a notebook's) hold CPUs the points' actors need
    at_once = concurrency(todo)
    say(f"running {len(todo)} point(s) on Ray Tune, {at_once} at a time")
    threads = server_threads(todo, at_once)
    for p in todo:  # unless the point says otherwise: the server's torch threads, its share of the CPUs
        if not any(o.split("=", 1)[0] == "resources.server_threads" for o in p["overrides"]):
            p["overrides"] = [*p["overrides"], f"resources.server_threads={threads}"]
    tuner = tune.Tuner(
        tune.with_resources(_trial, {"cpu": 0, "memory": 1}),  # the point's actors reserve the CPUs
        param_space={"point": tune.grid_search(todo), "files": files, "cwd": os.getcwd()},
        # each trial runs in a finished one's process, which kept that point's server and client
        # actors (runtime/pool.py): only the first points start processes; a point whose actors
        # reserve another CPU / GPU share stops the kept ones (pool.take_client_actors)
        tune_config=tune.TuneConfig(max_concurrent_trials=at_once, reuse_actors=True),
        run_config=tune.RunConfig(name="tune", storage_path=str(sweep_dir / ".tune"), verbose=0),
    )
    results = tuner.fit()  # Tune catches Ctrl-C itself: it stops the trials and returns
    return [(r.config["point"], (r.metrics or {}).get("raysim_error")
             or (str(r.error).splitlines()[-1] if r.error is not None else None)) for r in results]


def _diverged(run_dir: Path) -> bool:
    """Whether the point's run ended by diverging (its summary says so)."""
    summary = run_dir / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("status") == "diverged"


class SweepInterrupted(Exception):
    """Ctrl-C or SIGTERM before every point ran."""


# Keys every point sets itself: the sweep's flags say them.
POINT_KEYS = {"run_name": "--name (the sweep's folder; each point's folder is named by its grid values)",
              "resume": "rerunning the same sweep command (unfinished points resume from their checkpoints)"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value (fixed) or key=v1,v2,... (a grid axis)")
    p.add_argument("--file", type=Path, help="a sweep file (YAML: name, config, fixed, grid)")
    p.add_argument("--config", action="append", default=[], metavar="FILE", help="config file(s) for every point")
    p.add_argument("--name", help="the sweep's folder name (default: from the grid keys)")
    p.add_argument("--skip-listed", type=Path, metavar="CSV",
                   help="leave out the points a CSV lists by its grid-axis columns (a results table's runs.csv: "
                        "the runs another machine made)")
    p.add_argument("--tuned", type=Path, metavar="CSV",
                   help="a tuning.csv of tuning runs made elsewhere: its rows count as finished tuning points")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="the folder the sweep's folder goes in (default runs/sweeps; output_dir=DIR says the same)")
    p.add_argument("--processes", metavar="N",
                   help="run the points N at a time in processes of this machine, each point's clients in its own "
                        "process with no Ray (auto: one per CPU; default: the sweep file's `processes`, else 1)")
    p.add_argument("--record-tuning", type=Path, metavar="CSV",
                   help="run nothing: write the tuning runs finished so far as a tuning.csv at CSV (for --tuned "
                        "on another machine)")
    args = p.parse_args(argv)
    try:
        name, files, fixed, grid = parse(args.overrides, args.file)
        for key, use in POINT_KEYS.items():
            if any(o.split("=", 1)[0] == key for o in fixed) or key in grid:
                raise ConfigError(f"{key}= cannot be given to a sweep: use {use}")
        out = [o.split("=", 1)[1] for o in fixed if o.split("=", 1)[0] == "output_dir"]
        if "output_dir" in grid or len(out) > 1 or (out and args.output_dir and Path(out[0]) != args.output_dir):
            raise ConfigError("output_dir: give the sweep one output folder (output_dir=DIR or --output-dir DIR)")
        fixed = [o for o in fixed if o.split("=", 1)[0] != "output_dir"]
        args.output_dir = args.output_dir or Path(out[0].strip('"') if out else "runs/sweeps")
        name = args.name or folder_name(name, grid)
        if "/" in name or name in ("", ".", ".."):
            raise ConfigError(f"--name {name!r} must be a plain folder name")
        from raysim.preflight import can_create_in

        can_create_in("--output-dir", args.output_dir / name)  # a file in the way: one line, as raysim.run's
        skip = read_skip(args.file, grid)
        if args.skip_listed is not None:
            listed = read_listed(args.skip_listed, grid)
            hit = sum(skipped(dict(zip(grid, combo)), listed) for combo in itertools.product(*grid.values()))
            print(f"{args.skip_listed}: {len(listed)} row(s), {hit} of the grid's points listed: left out")
            skip += listed
        tuning = read_tune(args.file, grid)
        from raysim.sweep_pool import processes_wanted

        processes = (processes_wanted(args.processes, "--processes") if args.processes is not None
                     else read_processes(args.file))
        if args.record_tuning is not None:
            if tuning is None:
                raise ConfigError("--record-tuning needs a sweep file with a tune section (--file)")
            from raysim.tuning import record

            n = record(tuning, args.output_dir / name, args.record_tuning)
            print(f"{args.record_tuning}: {n} tuning runs recorded")
            return 0
        tuned = None
        if args.tuned is not None:
            from raysim.tuning import read_tuned

            tuned = read_tuned(args.tuned)
        given = [k for k, v in (o.split("=", 1) for o in args.overrides) if k not in grid and len(split_values(v)) == 1]
        sweep_dir = sweep([*files, *args.config], fixed, grid, name, args.output_dir, skip=skip, tuning=tuning,
                          tuned=tuned, per_cell=read_cells(args.file, grid, given), processes=processes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StartFailed as e:  # Ray did not start: not the input's fault
        print(f"error: {e}", file=sys.stderr)
        return 1
    except SweepInterrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before Tune took over (planning, starting Ray)
        print("sweep interrupted before its first point ran; rerun the same command", file=sys.stderr)
        return 130
    print(f"results: {sweep_dir}  (python -m raysim.results.table {sweep_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
