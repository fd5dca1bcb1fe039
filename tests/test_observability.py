"""Observability as a user meets it (issue 47): a run with `ray.dashboard=true` is opened in a
real headless Chromium the way its printed line says (the address, then the token pasted
into the Dashboard's prompt) and its server and client actors are in the Actors view; a
real Prometheus (Debian's package, installed by .ci/run) scrapes the run's metrics port and
answers `ray_raysim_accuracy` and `ray_raysim_rounds_done_total` with the run's values; the
shipped Grafana dashboard queries only metrics raysim exports.

RAYSIM_SCREENSHOTS=docs/images pytest tests/test_observability.py  also writes the
screenshots docs/cluster.md shows."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from browser import Page, chromium
from raysim.runtime.observe import EXPORTED


def test_the_grafana_dashboard_queries_only_metrics_raysim_exports_and_charts_them_all():
    from raysim.grafana import dashboard_path, main

    board = json.loads(dashboard_path().read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bray_raysim_\w+", e)}
    assert used <= set(EXPORTED), used - set(EXPORTED)
    assert set(EXPORTED) <= used, set(EXPORTED) - used  # every exported metric has a panel
    assert all('run=~"$run"' in e for e in exprs)  # every panel follows the run picker
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for what in ("accuracy", "loss", "round seconds", "dropouts", "bytes", "per client actor"):
        assert what in titles, what
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "run", "window"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _query(prom: int, expr: str) -> list:
    out = _get(f"http://127.0.0.1:{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    return out["data"]["result"]


@pytest.mark.skipif(chromium() is None or shutil.which("prometheus") is None,
                    reason="needs Debian's chromium and prometheus packages (.ci/run installs them)")
def test_a_run_is_in_the_dashboards_actors_view_and_in_a_real_prometheus(tmp_path):
    shots = os.environ.get("RAYSIM_SCREENSHOTS")
    metrics_port, prom_port = _free_port(), _free_port()
    env = dict(os.environ, RAY_metrics_report_interval_ms="1000")
    run = subprocess.Popen([sys.executable, "-m", "raysim.run", "ray.dashboard=true", f"ray.metrics_port={metrics_port}",
                            "dataset=digits", "model=mclr", "num_clients=20", "rounds=3000", "run_name=watched",
                            f"output_dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=tmp_path)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True).start()
    prom = page = None
    try:
        deadline = time.time() + 120
        while not any("Ray's dashboard:" in line for line in lines):
            assert run.poll() is None and time.time() < deadline, "".join(lines)
            time.sleep(0.2)
        line = next(line for line in lines if "Ray's dashboard:" in line)
        url = re.search(r"(http://\S+)", line).group(1)
        token_file = re.search(r"paste the contents of (\S+)", line).group(1)
        assert f"http://127.0.0.1:{metrics_port}/metrics" in "".join(lines)

        # Prometheus scrapes the run's metrics port every second
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: raysim\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{metrics_port}']\n")
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        # the Dashboard, as the line says: open the address, paste the token when it asks
        page = Page()
        page.open(url + "/#/actors")
        page.wait_for_text("Token", timeout=60)  # "Authentication Token Required"
        page.type_into("input[type=password]", Path(token_file).read_text().strip())  # the prompt's field
        page.press_enter()
        # the client actors (the server is the command's own process), started: the view refreshes
        page.wait_for_text("raysim-client-0.watched", "raysim-client-1.watched", "ALIVE", timeout=90)
        if shots:
            page.screenshot(Path(shots) / "dashboard-actors.png")

        # Prometheus answers with the run's values, tagged by its name
        deadline = time.time() + 120
        while not (_query(prom_port, 'ray_raysim_accuracy{run="watched"}')
                   and _query(prom_port, 'ray_raysim_rounds_done_total{run="watched"}')):
            assert time.time() < deadline, "Prometheus never got raysim's metrics"
            time.sleep(1)
        accuracy = float(_query(prom_port, 'ray_raysim_accuracy{run="watched"}')[0]["value"][1])
        rounds_done = float(_query(prom_port, 'sum(ray_raysim_rounds_done_total{run="watched"})')[0]["value"][1])
        if shots:
            page.open(f"http://127.0.0.1:{prom_port}/graph?g0.expr={urllib.parse.quote('ray_raysim_accuracy')}"
                      "&g0.tab=0&g0.range_input=1m")
            page.wait_for_text("ray_raysim_accuracy", timeout=30)
            time.sleep(2)
            page.screenshot(Path(shots) / "prometheus-raysim-accuracy.png")
    finally:
        if page is not None:
            page.close()
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        if run.poll() is None:
            run.send_signal(signal.SIGINT)  # Ctrl-C: the rounds so far are written
        run.wait(timeout=120)
    rows = pq.read_table(tmp_path / "watched" / "metrics.parquet").to_pylist()
    assert accuracy in {r["accuracy"] for r in rows}  # one of the run's evaluations, as the run wrote it
    assert 1 <= rounds_done <= len(rows)
