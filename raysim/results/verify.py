"""`python -m raysim.results.table --sweep F --doc D --verify N [--draw K]`: re-run N rows of a
published table from the configs it links and say whether they come out as recorded (issues
72, 84).

Rows are drawn at random (seeded by `draw`, so another draw checks other rows), each run again
from `<side>/<setting>/<algorithm>.yaml` at its seed, and compared with its row of runs.csv:

- the config: at the row's commit the re-run's `config_sha256` must be the row's (else the
  linked config is not the run the row records: a failure); at another commit an option added
  since changes the hash as well, so a different hash is reported, not judged;
- the code: a re-run is made by the raysim it runs under (HEAD); a row made at another commit
  is said to be (its bits may differ by a code change, not only by the machine);
- the bits: on the processor, instruction set and torch build the row was made on (its
  `client_processors`) the model must be the same bits (`model_sha256`); elsewhere float
  rounding differs and nothing is passed or failed: the re-run's final accuracy is reported
  beside the row's, with the cell's seeds' standard deviation to read the difference by."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from raysim.errors import ConfigError
from raysim.results.published import read_records
from raysim.results.runs import mean_std

_CAPABILITY = re.compile(r" \([A-Z0-9_]+\)(?=,)")  # "AMD EPYC (AVX512), torch ..." -> "AMD EPYC, torch ..."


def verify(doc: Path, n: int, draw: int = 0, say=print) -> list[dict]:
    """Re-run `n` random rows (`draw`: the draw's seed) of `doc`'s runs.csv; one result per
    row: {row, same_machine, same_commit, ok (True / False / None: not judged, another
    processor), what}."""
    from raysim.provenance import code_version

    def run(args: list[str]) -> int:  # the row's command itself, in its own process (this floor imports no CLI)
        return subprocess.run([sys.executable, "-m", "raysim.run", *args]).returncode

    if n < 1:
        raise ConfigError(f"--verify {n}: the number of rows to re-run must be 1 or more")
    side = doc.with_suffix("")  # the folder beside the document (published.write_doc)
    rows = read_records(side / "runs.csv")
    if not rows:
        raise ConfigError(f"--verify: {side / 'runs.csv'} has no runs; make the table first")
    keys = random.Random(draw).sample(sorted(rows), min(n, len(rows)))
    head = code_version()
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
                out.append({"row": key, "same_machine": None, "same_commit": None, "ok": False,
                            "what": f"the run failed (exit {rc})"})
                say(f"  {out[-1]['what']}")
                continue
            again = json.loads(summary_file.read_text())
            made_at = row.get("raysim_commit") or "not recorded"
            same_commit = made_at == head
            commit = "" if same_commit else f" (re-run at HEAD {head[:12]}, the row made at {made_at[:12]})"
            if row.get("config_sha256") and again.get("config_sha256") != row["config_sha256"]:
                # at the row's commit the linked config must be the row's run; across commits an option
                # added to raysim since (at its default) changes the hash too, so that is said, not judged
                what = (f"{'DIFFERENT config' if same_commit else 'not judged: another config hash'}: the linked "
                        f"config hashes to {str(again.get('config_sha256'))[:12]}, the row's run to "
                        f"{row['config_sha256'][:12]}{commit}")
                out.append({"row": key, "same_machine": None, "same_commit": same_commit,
                            "ok": False if same_commit else None, "what": what})
                say(f"  {what}")
                continue
            here = "; ".join(again.get("client_processors") or [])
            recorded = row.get("client_processors") or ""
            # a row of before issue 84 names no instruction set: its bits are compared on the name
            unnamed = here != recorded and _CAPABILITY.sub("", here) == recorded
            same = here == recorded or unnamed
            if same:
                ok = again.get("model_sha256") == row.get("model_sha256")
                what = ("the same bits" if ok else (f"DIFFERENT bits ({str(again.get('model_sha256'))[:12]} against "
                                                    f"{str(row.get('model_sha256'))[:12]})")) + commit
                what += f" (the row names no instruction set; here: {here})" if unnamed else ""
            else:
                ok = None
                cell = [r["final_accuracy"] for k, r in rows.items() if k[:2] == key[:2] and
                        r.get("final_accuracy") is not None]
                std = mean_std(cell)[1] if cell else None
                acc, was = again.get("final_accuracy"), row.get("final_accuracy")
                diff = (f"{100 * (acc - was):+.2f} points" if acc is not None and was is not None else "not comparable")
                what = (f"not judged: on {here}, not the row's {row.get('client_processors') or 'unrecorded processor'}: "
                        f"final accuracy {acc if acc is None else f'{acc:.4f}'} against the row's "
                        f"{was if was is None else f'{was:.4f}'} ({diff}; "
                        + (f"the cell's seeds' std {100 * std:.2f} points over {len(cell)} runs" if cell else
                           "no run of the cell records a final accuracy") + f"){commit}")
            say(f"  {what}")
            out.append({"row": key, "same_machine": same, "same_commit": same_commit, "ok": ok, "what": what})
    return out
