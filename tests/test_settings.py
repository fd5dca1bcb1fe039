"""Every setting does what it says (issue 17): through the real CLI or the Python API."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

import raysim
from raysim import registry
from raysim.errors import ConfigError
from raysim.run import main

REPO = Path(__file__).resolve().parent.parent


def cli(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "raysim.run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, **kw)


# ---------------------------------------------------------------- names alone run (4b)
def built_in(reg) -> list[str]:
    """The names raysim registers itself (not those of test or example plugins imported here)."""
    return [n for n in reg.names() if registry.module_of(reg.get(n)).startswith("raysim.")]


NAMES = [("algorithm", n) for n in built_in(registry.ALGORITHMS)] + \
        [("selection", n) for n in built_in(registry.SELECTIONS) if n != "random"]


@pytest.mark.parametrize("key,name", NAMES)
def test_every_algorithm_and_selection_runs_with_only_its_name(ray_local, tmp_path, key, name):
    """`algorithm=X` alone is a valid experiment: its config group sets what it needs
    (FedConcat's encoder rounds below `rounds`, SCAFFOLD's plain SGD), every check that needs
    no data passes, and so do the data checks. Then it trains: the same config, cut to 3
    rounds to keep the suite short (FedConcat: 2 of them encoder rounds)."""
    from raysim.experiment import prepare
    from raysim.launch import check

    _, cfg = check([], [f"{key}={name}", f"output_dir={tmp_path}"])
    prepare(cfg)
    short = ["rounds=5" if name == "fed2" else "rounds=3"]  # Fed2's VGG-9 at lr 0.01 is above chance from round 4
    short += ["fedconcat.encoder_rounds=2"] if name.startswith("fedconcat") else []
    assert main([f"{key}={name}", *short, f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["rounds"] == int(short[0].split("=")[1]) and s["status"] == "finished"
    if not name.startswith("fedconcat"):  # its 1 classifier round of 3 steps is not meant to learn yet
        # above chance (0.1); runs are deterministic, so not flaky. Clustered FL (a model per
        # group) is judged on the clients' own test data: its global test set has no group.
        # A personalised method: its clients' own models (its global model may be no one's).
        assert (s.get("final_personal_accuracy") or s.get("final_local_accuracy", s["final_accuracy"])) > 0.13, s


EXPERIMENTS = sorted((Path(__file__).resolve().parent.parent / "configs" / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_shipped_experiment_config_passes_the_checks_and_its_algorithms_read_it(path, tmp_path):
    """A paper's set-up file is valid as shipped, for its own algorithm and for every other
    algorithm whose section it carries (one file, a row of a paper's table)."""
    from omegaconf import OmegaConf

    from raysim.config import plugin_sections
    from raysim.launch import check

    check([str(path)], [f"output_dir={tmp_path}"])
    in_file = set(OmegaConf.load(path))
    carried = {name for s, (key, names) in plugin_sections().items() if key == "algorithm" and s in in_file
               for name in names}
    for algorithm in sorted(carried):
        check([str(path)], [f"output_dir={tmp_path}", f"algorithm={algorithm}"])


# ---------------------------------------------------------------- config groups (3) and sections (2)
def test_choosing_a_dataset_or_algorithm_applies_its_config_group_and_says_so(tmp_path):
    r = cli(["--print-config", "dataset=cifar10"], tmp_path)
    assert r.returncode == 0 and "\nmodel: cnn\n" in r.stdout
    assert "config: default.yaml < dataset/cifar10.yaml < algorithm/fedavg.yaml" in r.stderr, r.stderr
    r = cli(["--print-config", "dataset=cifar10", "model=mlp", "algorithm=scaffold"], tmp_path)
    assert "\nmodel: mlp\n" in r.stdout  # what the user sets wins over the group
    assert "  momentum: 0.0\n" in r.stdout and "algorithm/scaffold.yaml" in r.stderr


def test_a_section_the_run_does_not_read_is_refused_and_fedconcat_id_reads_fedconcat(tmp_path):
    r = cli(["algorithm=fedavg", "fedprox.mu=1"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "fedprox.* is set but algorithm=fedavg does not read the fedprox section" in r.stderr
    r = cli(["--print-config", "algorithm=fedconcat_id", "fedconcat.encoder_rounds=7"], tmp_path)
    assert r.returncode == 0 and "  encoder_rounds: 7\n" in r.stdout and "fedconcat_id:" not in r.stdout
    # a --config file may carry several algorithms' sections (one file, a comparison): noted, not refused
    r = cli(["--print-config", "--config", "configs/experiments/fedconcat_table1_c2.yaml", "algorithm=fedavg"], tmp_path)
    assert r.returncode == 0 and "experiments/fedconcat_table1_c2.yaml sets fedconcat.*, which algorithm=fedavg " \
                                  "does not read" in r.stderr, r.stderr
    # a run's own config.yaml holds every section, the unread ones at their defaults: rerun, it says nothing of them
    r = cli(["--print-config", "algorithm=fedavg", "rounds=3"], tmp_path)
    (tmp_path / "run.yaml").write_text(r.stdout)
    r = cli(["--print-config", "--config", str(tmp_path / "run.yaml")], tmp_path)
    assert r.returncode == 0 and "does not read" not in r.stderr, r.stderr
    (tmp_path / "run.yaml").write_text(r.stdout.replace("fedprox:\n  mu: 0.01\n", "fedprox:\n  mu: 0.5\n"))
    r = cli(["--print-config", "--config", str(tmp_path / "run.yaml")], tmp_path)
    assert "run.yaml sets fedprox.*, which algorithm=fedavg does not read" in r.stderr, r.stderr


# ---------------------------------------------------------------- an installed raysim (4)
def test_an_installed_wheel_carries_the_configs_and_finds_them_from_any_directory(tmp_path):
    """`pip install .` (no -e): the wheel holds default.yaml, the groups and the experiments,
    and a --config named as in the README resolves from the package."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("raysim-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("raysim/configs/default.yaml", "raysim/configs/dataset/cifar10.yaml",
              "raysim/configs/algorithm/fedconcat.yaml", "raysim/configs/experiments/niid_bench_mnist_c2.yaml",
              "raysim/algorithms/fedavg.py", "raysim/algorithms/fed2.py"):  # the top-level folders, mapped
        assert f in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    r = cli(["--print-config", "--config", "configs/experiments/niid_bench_mnist_c2.yaml"], elsewhere, env=env)
    assert r.returncode == 0, r.stderr
    where = subprocess.run([sys.executable, "-c", "import raysim.config as c; print(c.CONFIG_DIR)"], env=env,
                           cwd=elsewhere, capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(site / "raysim" / "configs")  # the installed copy, not the clone
    where = subprocess.run([sys.executable, "-c", "import raysim.algorithms.fedavg as a; print(a.__file__)"], env=env,
                           cwd=elsewhere, capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(site / "raysim" / "algorithms" / "fedavg.py")
    assert "  epochs: 10\n" in r.stdout and "\nmodel: cnn\n" in r.stdout
    r = cli(["--print-config"], elsewhere, env=env)
    assert "  epochs: 2\n" in r.stdout and "  batch_size: 32\n" in r.stdout  # default.yaml's, not the dataclass's


def test_the_top_level_algorithms_and_configs_folders_are_the_packages_from_any_directory(tmp_path):
    """The clone's `algorithms/` and `configs/` are `raysim.algorithms` and `raysim.configs`
    (pyproject's package-dir mapping, editable install), from any directory, and a folder
    there named `algorithms` is not them."""
    (tmp_path / "algorithms").mkdir()
    (tmp_path / "algorithms" / "__init__.py").write_text("raise SystemExit('the user folder was imported')\n")
    code = ("import raysim.algorithms as a, raysim.config as c; from raysim import registry; "
            "print(a.__file__); print(c.CONFIG_DIR); print(len(registry.ALGORITHMS.names()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    algorithms, configs, n = r.stdout.split()
    assert Path(algorithms) == REPO / "algorithms" / "__init__.py" and Path(configs) == REPO / "configs"
    assert int(n) >= 19
    r = cli(["--print-config", "--config", "configs/experiments/niid_bench_mnist_c2.yaml"], tmp_path)
    assert r.returncode == 0 and "  epochs: 10\n" in r.stdout, r.stderr


def test_a_second_checkout_pairs_its_raysim_with_its_own_algorithms_and_configs(tmp_path):
    """The editable install maps raysim.algorithms to the checkout pip installed last; run
    from another checkout, raysim still takes that checkout's own folders (raysim/__init__)."""
    import shutil

    clone = tmp_path / "clone"
    for name in ("raysim", "algorithms", "configs"):
        shutil.copytree(REPO / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", clone)
    (clone / "algorithms" / "zz_marker.py").write_text(
        "from raysim.algorithms.fedavg import FedAvg\nfrom raysim.registry import ALGORITHMS\n\n\n"
        "@ALGORITHMS.register('clone_marker')\nclass Marker(FedAvg):\n    pass\n")
    code = ("import raysim.algorithms.fedavg as a, raysim.config as c; from raysim import registry; "
            "print(a.__file__); print(c.CONFIG_DIR); print('clone_marker' in registry.ALGORITHMS.names())")
    r = subprocess.run([sys.executable, "-c", code], cwd=clone, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    algorithms, configs, marker = r.stdout.split()
    assert Path(algorithms) == clone / "algorithms" / "fedavg.py" and Path(configs) == clone / "configs"
    assert marker == "True"


def test_an_edited_algorithm_file_changes_the_code_stamp_that_keeps_workers_warm():
    """Warm workers are reused only while `code_stamp` is unchanged: it covers the mapped
    algorithms folder as well as the raysim package."""
    from raysim.runtime.pool import code_stamp

    f = REPO / "algorithms" / "uniform.py"
    before = code_stamp([])
    assert str(f) in {path for path, _, _ in before}
    st = f.stat()
    try:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert code_stamp([]) != before
    finally:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert code_stamp([]) == before


# ---------------------------------------------------------------- faults, banner (1, 5)
def test_a_kill_fraction_that_rounds_to_zero_still_kills_one_actor(ray_local, tmp_path, capfd):
    assert main(["faults.kill_fraction=0.25", "faults.kill_rounds=[2]", "rounds=3", "resources.num_actors=2",
                 f"output_dir={tmp_path}", "run_name=k", "--quiet"]) == 0  # 0.25 x 2 actors rounds to 0
    log = (tmp_path / "k" / "log.txt").read_text()
    killed = [line for line in log.splitlines() if "fault injection kills client actors" in line]
    assert len(killed) == 1 and not killed[0].endswith("[]"), killed
    rows = pq.read_table(tmp_path / "k" / "clients.parquet").to_pylist()
    assert any(r["round"] == 2 and r["redone"] for r in rows) and not any(r["status"] == "dropped" for r in rows)
    assert main(["faults.kill_fraction=0.25", "rounds=3", f"output_dir={tmp_path}", "run_name=k2", "--quiet"]) == 2
    assert "faults.kill_fraction=0.25 and faults.kill_rounds=[] go together" in capfd.readouterr().err
    assert not (tmp_path / "k2").exists()


def test_the_banner_names_selection_system_heterogeneity_and_faults(ray_local, tmp_path, capfd):
    assert main(["selection=fedentopt", "system.dropout=0.2", "system.stragglers=0.5", "faults.kill_fraction=0.5",
                 "faults.kill_rounds=[2]", "rounds=2", f"output_dir={tmp_path}", "run_name=b"]) == 0
    err = capfd.readouterr().err
    banner = next(line for line in err.splitlines() if "with fedentopt selection" in line)
    assert "system: dropout 0.2, stragglers 0.5 (1-5 epochs)" in banner
    assert "faults: kill 0.5 of the client actors in rounds [2]" in banner
    for step in ("config: default.yaml", "data ready; waiting for", "run directory: "):
        assert step in err, step  # start-up progress (Ray was already up in this test session)
    # the server process: a new one, or the last run's (ray.reuse_workers)
    assert "starting the server" in err or "the server and client actors of the last run are reused" in err


# ---------------------------------------------------------------- the Python API (12)
def test_simulate_returns_the_summary_and_metrics_as_dataframes(ray_local, tmp_path):
    res = raysim.simulate(rounds=3, num_clients=8, output_dir=str(tmp_path), run_name="api", progress=False,
                          overrides={"local.epochs": 1, "partition.beta": 0.3})
    assert res.run_dir == tmp_path / "api" and res.summary["rounds"] == 3
    m = res.metrics
    assert list(m["round"]) == [1, 2, 3] and m["accuracy"].iloc[-1] == res.summary["final_accuracy"]
    assert set(res.clients["round"]) == {1, 2, 3} and res.config.partition.beta == 0.3
    assert raysim.load(res.run_dir).summary == res.summary
    with pytest.raises(ConfigError, match="partition.beta must be > 0"):
        raysim.simulate(overrides=["partition.beta=0"], output_dir=str(tmp_path), progress=False)
    with pytest.raises(ConfigError, match="fedprox.\\* is set but algorithm=fedavg"):
        raysim.simulate(overrides={"fedprox.mu": 0.1}, output_dir=str(tmp_path), progress=False)


# ---------------------------------------------------------------- --list, a misfit model (11)
def test_list_shows_a_plugins_parts_and_a_misfit_model_names_those_that_fit(tmp_path):
    r = cli(["--list", "plugins=[stateful_plugin]"], tmp_path)
    assert r.returncode == 0 and "test_state_counter (from stateful_plugin)" in r.stdout, r.stdout
    r = cli(["--show-partition", "model=cnn", "--quiet"], tmp_path)  # digits are 8x8 greyscale
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model='cnn' does not fit dataset 'digits'" in r.stderr
    fit = r.stderr.split("models that fit: ")[1].strip().split(", ")
    assert "mclr" in fit and "mlp" in fit and "cnn" not in fit


# ---------------------------------------------------------------- stopping (9, 11)
def _ray_tree(pid: int) -> list:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stopping_says_how_to_resume_and_leaves_no_ray_processes(tmp_path, how):
    """SIGTERM (the CLI's handler is Ctrl-C's too: run.py `_terminate`; Ctrl-C itself is tested on
    a sweep, tests/test_workflow.py): exit 130, the run directory and the resume= command on
    stderr. Both (SIGKILL through raysim.runtime.reaper): every process of the local Ray the CLI
    started, agents and dashboard included, gone. The dashboard's address is printed when it is on."""
    args = ["rounds=400", "checkpoint_every=2", "ray.num_cpus=2", f"output_dir={tmp_path}", "run_name=stop"]
    if how == signal.SIGTERM:
        args.append("ray.dashboard=true")
    p = subprocess.Popen([sys.executable, "-m", "raysim.run", *args], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    err = []
    for line in p.stderr:  # wait for the run to start
        err.append(line)
        if "run directory:" in line:
            break
    deadline = time.time() + 60
    while not (tmp_path / "stop" / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.2)
    tree = _ray_tree(p.pid)
    daemons = " ".join(" ".join(c.cmdline()) for c in tree if c.is_running())
    assert any("raylet" in " ".join(c.cmdline()) for c in tree if c.is_running())
    os.kill(p.pid, how)
    rest = p.stderr.read()
    if how == signal.SIGKILL:
        assert p.wait(timeout=60) == -signal.SIGKILL
    else:
        assert p.wait(timeout=60) == 130, rest
        assert f"resume={tmp_path / 'stop'}" in rest and "Traceback" not in rest and "SIGABRT" not in rest, rest
    if how == signal.SIGTERM:
        assert any("dashboard: http://127.0.0.1:" in line for line in err), err
        # with the Dashboard on, the daemons its views read run too (ray_session.without_cluster_daemons)
        assert "log_monitor.py" in daemons
    deadline = time.time() + 20
    while time.time() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in tree):
        time.sleep(0.5)
    left = [" ".join(c.cmdline())[:80] for c in tree if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, left
    assert (tmp_path / "stop" / "checkpoint.pt").exists()
