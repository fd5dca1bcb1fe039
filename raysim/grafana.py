"""`python -m raysim.grafana [FOLDER]`: put raysim's Grafana dashboard where Grafana loads it.

The dashboard (`raysim/grafana_dashboard.json`, installed with the package) charts the
platform's metrics (`ray_raysim_*`, runtime/observe.py) per run: accuracy and test loss at
each evaluation, the round, round seconds, rounds per minute, client updates and dropouts
per second, bytes down / up per second, and each client actor's client calls per second.
Its Prometheus data source is a dashboard variable, as in Ray's own dashboards.

FOLDER defaults to the Grafana dashboards folder of the newest local Ray session
(`<ray temp>/session_latest/metrics/grafana/dashboards`), which Ray's generated provisioning
(`.../metrics/grafana/provisioning/dashboards/default.yml`) tells Grafana to load: start
Grafana with `--config <ray temp>/session_latest/metrics/grafana/grafana.ini` and it shows
"raysim" beside Ray's dashboards; with `RAY_GRAFANA_HOST` set when Ray starts, the
Dashboard's Metrics view embeds them. Any other Grafana: import the printed file.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

NAME = "grafana_dashboard.json"


def dashboard_path() -> Path:
    """The shipped dashboard JSON."""
    return Path(str(resources.files("raysim") / NAME))


def ray_dashboards_folder() -> Path:
    return Path(tempfile.gettempdir()) / "ray" / "session_latest" / "metrics" / "grafana" / "dashboards"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raysim.grafana", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", type=Path, help="where to copy it (default: the newest local Ray session's "
                   "Grafana dashboards folder)")
    p.add_argument("--print-path", action="store_true", help="print the shipped file's path and copy nothing")
    args = p.parse_args(argv)
    if args.print_path:
        print(dashboard_path())
        return 0
    folder = args.folder or ray_dashboards_folder()
    if not folder.is_dir():
        print(f"error: {folder} is not a folder" + ("" if args.folder else " (no local Ray session has started "
              "Ray's Grafana files yet: start a run with ray.dashboard=true, or name a folder)"), file=sys.stderr)
        return 2
    out = folder / "raysim_grafana_dashboard.json"
    shutil.copyfile(dashboard_path(), out)
    print(f"raysim's Grafana dashboard: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
