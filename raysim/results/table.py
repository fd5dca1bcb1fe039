"""`python -m raysim.results.table PATH...`: a paper-style table of finished runs.

PATH: run directories or folders holding them (a sweep directory). Rows and columns are
config keys (`--rows dataset,partition.name --cols algorithm`, the papers' layout); runs
that share a cell (seeds) give "mean +- std" (sample std). `--metric`: any summary.json field
(`final_accuracy`, default; `best_accuracy`, `last10_mean_accuracy`, `wall_seconds`, ...) or
a per-round metric NAME of metrics.parquet (`accuracy`, `loss`, `mib`: cumulative traffic):
`NAME@R` (at round R), `NAME@XMiB` (at the last round within X MiB: equal communication),
`mean(NAME)`, `max(NAME)`, `min(NAME)`, `lastK(NAME)` (mean of the last K values),
`round(NAME>=X)` (first round reaching X: rounds to a target; "never" counts the runs that do
not), `time(NAME>=X)` (the simulated seconds at the end of that round, with a `system.profile`); `last10(accuracy@1174MiB)` limits a function to the curve within the budget. Several
`--metric`s: one column each. Accuracies are shown in percent; a cell says how many of its
runs diverged (their curves end early). `--format`: markdown (default), csv, latex; `--out
FILE` writes it there too.

    python -m raysim.results.table runs/sweeps/fedavg-vs-fedprox --rows partition.beta --cols algorithm

`--sweep configs/sweeps/results_table.yaml --doc docs/results.md`: the published table of every
algorithm (raysim/results/published.py).
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from raysim.errors import ConfigError
from raysim.results.runs import METRICS_HELP, check_keys, differing_keys, find_runs, mean_std, parse_metric


def _keys(text: str | None) -> list[str]:
    return [k for k in (text or "").split(",") if k]


def build(paths: list, rows: list[str] | None, cols: list[str] | None, metrics: list[str]) -> tuple[list, list, dict, dict]:
    """(row labels, column labels, {(row, col): cell text}, {(row, col): number of runs}).
    With several metrics, each column is repeated per metric (the metric is the last column key)."""
    runs = find_runs(paths)
    for metric in metrics:
        parse_metric(metric)
    varying = differing_keys(runs)
    if cols is None:
        cols = ["algorithm"] if "algorithm" in varying else []
    if rows is None:
        rows = [k for k in varying if k not in cols]
    check_keys(runs, rows + cols)
    for metric in metrics:
        if all(r.value(metric) is None for r in runs):
            raise ConfigError(f"--metric {metric}: no run has it; summary fields: {', '.join(sorted(runs[0].summary))}, "
                              f"or a form of metrics.parquet's columns ({METRICS_HELP})")
    groups: dict[tuple, list] = {}
    for r in runs:
        row = tuple(_shown(r, k) for k in rows)
        for metric in metrics:
            col = tuple(_shown(r, k) for k in cols) + ((metric,) if len(metrics) > 1 else ())
            groups.setdefault((row, col), []).append((r, metric, r.value(metric)))
    row_labels = sorted({k[0] for k in groups}, key=_natural)
    col_labels = sorted({k[1][:len(cols)] for k in groups}, key=_natural)
    if len(metrics) > 1:
        col_labels = [c + (m,) for c in col_labels for m in metrics]
    cells, counts = {}, {}
    for key, got in groups.items():
        metric = got[0][1]
        percent = "accuracy" in metric and not metric.startswith(("round(", "time("))
        values = [100 * v if percent else v for _, _, v in got if v is not None]
        counts[key] = len(values)
        if values:
            m, s = mean_std(values)
            cells[key] = f"{m:.1f} +- {s:.1f}" if percent else f"{m:.4g} +- {s:.2g}"
        else:
            cells[key] = "-"
        if len(values) < len(got) and metric.startswith(("round(", "time(")):  # runs that never reach the target
            cells[key] += f" ({len(got) - len(values)} never)"
        diverged = sum(r.summary.get("status") == "diverged" for r, _, _ in got)
        if diverged:  # their curves end early: the cell is not over the whole run
            cells[key] += f" ({diverged} diverged)"
    return [rows, row_labels], [cols + (["metric"] if len(metrics) > 1 else []), col_labels], cells, counts


def _shown(run, key: str) -> str:
    """A run's value of a config key; "-" where the run does not have the key (a section of
    another algorithm)."""
    return str(run.config[key]) if key in run.config else "-"


def _natural(labels: tuple) -> tuple:
    out = []
    for x in labels:
        try:
            out.append((0, float(x), ""))
        except ValueError:
            out.append((1, 0.0, x))
    return tuple(out)


def render(rows, cols, cells, fmt: str) -> str:
    row_keys, row_labels = rows
    col_keys, col_labels = cols
    head = [" / ".join(row_keys) or "run"] + [", ".join(c) or "value" for c in col_labels]
    body = [[", ".join(r) or "all"] + [cells.get((r, c), "") for c in col_labels] for r in row_labels]
    if fmt == "csv":
        out = io.StringIO()
        csv.writer(out).writerows([head, *body])
        return out.getvalue()
    if fmt == "latex":
        esc = lambda t: t.replace("_", r"\_").replace("+-", r"$\pm$")  # noqa: E731
        lines = [r"\begin{tabular}{l" + "c" * (len(head) - 1) + "}", r"\toprule",
                 " & ".join(esc(h) for h in head) + r" \\", r"\midrule"]
        lines += [" & ".join(esc(c) for c in row) + r" \\" for row in body]
        return "\n".join(lines + [r"\bottomrule", r"\end{tabular}"]) + "\n"
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.results.table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="run directories or folders holding them")
    p.add_argument("--sweep", type=Path, help="the published table instead: a sweep file over setting, algorithm and "
                   "seed (configs/sweeps/results_table.yaml); with --doc, writes that document (raysim/results/published.py)")
    p.add_argument("--doc", type=Path, help="with --sweep: the markdown file to write (docs/results.md)")
    p.add_argument("--runs-dir", type=Path, help="with --sweep: where the sweep's folder is (default runs/sweeps)")
    p.add_argument("--allow-mixed", action="store_true", help="with --sweep: accept runs of several raysim commits "
                   "(the document's header then says so; by default a table is made from one commit's runs)")
    p.add_argument("--verify", type=int, metavar="N", help="with --sweep and --doc: re-run N random rows of the "
                   "table from their configs and report whether they give the recorded bits (the same processor, instruction set and "
                   "torch, and the same config hash); on another processor each re-run's accuracy is reported beside the "
                   "row's, not judged; writes nothing (raysim/results/verify.py)")
    p.add_argument("--draw", type=int, default=0, metavar="K", help="with --verify: the seed of the rows' draw "
                   "(default 0); another K checks other rows")
    p.add_argument("--last", type=int, help="with --sweep: a run's accuracy is the mean of its last N evaluations "
                   "(default: the sweep file's tune.last, else 3)")
    p.add_argument("--rows", help="config keys for the rows, comma-separated (default: every key that differs "
                                  "between the runs, but the columns' and the seed)")
    p.add_argument("--cols", help="config keys for the columns (default: algorithm, when it differs)")
    p.add_argument("--metric", action="append", help="what each cell shows (default final_accuracy); several "
                   "--metric options: one column per metric. " + METRICS_HELP)
    p.add_argument("--format", choices=["markdown", "csv", "latex"], default="markdown")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    args = p.parse_args(argv)
    if args.sweep is not None or args.doc is not None:
        return _published(args)
    if not args.paths:
        p.error("give run directories (PATH ...) or --sweep FILE --doc OUT")
    try:
        rows, cols, cells, counts = build(args.paths, _keys(args.rows) if args.rows is not None else None,
                                          _keys(args.cols) if args.cols is not None else None,
                                          args.metric or ["final_accuracy"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = render(rows, cols, cells, args.format)
    print(text, end="")
    n = sorted(set(counts.values()))
    print(f"{', '.join(args.metric or ['final_accuracy'])}: mean +- std over {'/'.join(map(str, n))} run(s) per cell", file=sys.stderr)
    if args.out:
        args.out.write_text(text)
    return 0


def _published(args) -> int:
    from raysim.results.published import write_doc

    if args.sweep is None or args.doc is None or args.paths:
        print("error: --sweep FILE --doc OUT go together, with no run directories", file=sys.stderr)
        return 2
    if args.verify is not None:
        from raysim.results.verify import verify

        try:
            results = verify(args.doc, args.verify, draw=args.draw)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        bad = [r for r in results if r["ok"] is False]
        judged = sum(r["ok"] is not None for r in results)
        other = sum(not r["same_commit"] for r in results if r["same_commit"] is not None)
        print(f"verified {len(results)} row(s) (draw {args.draw}): {judged - len(bad)} as recorded, {len(bad)} not, "
              f"{len(results) - judged} not judged (another processor: accuracy reported)"
              + (f"; {other} made at another commit than HEAD" if other else ""))
        return 1 if bad else 0
    try:
        got = write_doc(args.sweep, args.doc, args.runs_dir,
                        command=f"python -m raysim.results.table --sweep {args.sweep} --doc {args.doc}"
                                + (" --allow-mixed" if args.allow_mixed else "")
                                + (f" --last {args.last}" if args.last else ""),
                        allow_mixed=args.allow_mixed, last=args.last)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.doc}: {got['done']} of {got['runs']} runs done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
