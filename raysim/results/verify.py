"""`python -m raysim.results.table --sweep F --doc D --verify N`: re-run N rows of the published
table from the configs it links and say whether they come out as recorded (issue 72).

A row is drawn at random (seeded), run again from `<doc dir>/results/<setting>/<algorithm>.yaml`
at its seed, and compared with its row of runs.csv: on the same processor and torch build as
the row was made on (its `client_processors`) the model must be the same bits
(`model_sha256`); elsewhere float rounding differs, and the accuracy must fall within the
cell's spread over its seeds (from the lowest seed's accuracy less one standard deviation to
the highest's plus one)."""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from raysim.errors import ConfigError
from raysim.results.published import read_records
from raysim.results.runs import mean_std


def verify(doc: Path, n: int, draw: int = 0, say=print) -> list[dict]:
    """Re-run `n` random rows of `doc`'s runs.csv; one result per row: {row, same_machine,
    ok, what}."""
    from raysim.run import main as run

    side = doc.with_suffix("")  # the folder beside the document (published.write_doc)
    rows = read_records(side / "runs.csv")
    if not rows:
        raise ConfigError(f"--verify: {side / 'runs.csv'} has no runs; make the table first")
    keys = random.Random(draw).sample(sorted(rows), min(n, len(rows)))
    out = []
    with tempfile.TemporaryDirectory(prefix="raysim-verify-") as tmp:
        for i, key in enumerate(keys):
            row = rows[key]
            setting, algorithm, seed = key
            config = side / setting / f"{algorithm}.yaml"
            if not config.is_file():
                raise ConfigError(f"--verify: {config} (the config of row {setting}/{algorithm}) is missing")
            say(f"verify {i + 1}/{len(keys)}: {setting}/{algorithm} seed {seed}")
            rc = run(["--config", str(config), f"seed={seed}", f"output_dir={tmp}", f"run_name=r{i}", "--quiet"])
            summary_file = Path(tmp) / f"r{i}" / "summary.json"
            if not summary_file.is_file():
                out.append({"row": key, "same_machine": None, "ok": False, "what": f"the run failed (exit {rc})"})
                continue
            again = json.loads(summary_file.read_text())
            here = "; ".join(again.get("client_processors") or [])
            same = here == (row.get("client_processors") or "")
            if same:
                ok = again.get("model_sha256") == row.get("model_sha256")
                what = "the same bits" if ok else (f"DIFFERENT bits ({str(again.get('model_sha256'))[:12]} against "
                                                   f"{str(row.get('model_sha256'))[:12]})")
            else:
                cell = [r["final_accuracy"] for k, r in rows.items() if k[:2] == key[:2] and
                        r.get("final_accuracy") is not None]
                _, std = mean_std(cell)
                low, high = min(cell) - std, max(cell) + std
                acc = again.get("final_accuracy")
                ok = acc is not None and low <= acc <= high
                what = (f"on {here}, not {row.get('client_processors')}: final accuracy {acc:.4f} "
                        f"{'within' if ok else 'OUTSIDE'} the seeds' spread [{low:.4f}, {high:.4f}]")
            say(f"  {what}")
            out.append({"row": key, "same_machine": same, "ok": ok, "what": what})
    return out
