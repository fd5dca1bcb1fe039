"""Hardening, part 3 (issue 46), through the real CLI where a user meets it: a key given
twice, labels outside the dataset's classes, a tracker that cannot open (no run directory
left) or fails mid-run, num_cpus_per_actor=0, a warm service of another version."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from raysim.config import ConfigError, load_config

SMALL = ["dataset=digits", "model=mclr", "num_clients=4", "rounds=1", "--quiet"]


def cli(args, cwd, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "raysim.run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def one_error_line(r) -> str:
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("raysim [")]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


def test_a_key_given_twice_names_the_file_the_key_and_both_lines(tmp_path):
    (tmp_path / "exp.yaml").write_text("rounds: 2\nlocal:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\nrounds: 3\n")
    r = cli(["--config", "exp.yaml", f"output_dir={tmp_path / 'out'}", "--quiet"], tmp_path)
    line = one_error_line(r)
    assert "exp.yaml" in line and "key rounds appears twice (lines 1 and 6)" in line, line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"key local\.lr appears twice \(lines 2 and 4\)"):
        _load_text("local:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n")
    assert _load_text("a: &x {b: 1}\nc: *x\nd: {<<: *x, e: 2}\n")["d"] == {"b": 1, "e": 2}  # aliases, merges: fine


def _load_text(text):
    from raysim.config.files import load_yaml

    return load_yaml(text, "the file")


def test_a_label_outside_the_classes_names_the_label_file_and_the_value(tmp_path):
    from test_datasets import write_idx

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 60)
    labels[17] = 200
    write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (60, 28, 28)))
    write_idx(raw / "train-labels-idx1-ubyte", labels)
    write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28)))
    write_idx(raw / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 20))
    r = cli(["dataset=mnist", f"data_dir={tmp_path}", "download=false", "num_clients=5",
             f"output_dir={tmp_path / 'out'}", "--quiet"], tmp_path)
    line = one_error_line(r)
    assert "train-labels-idx1-ubyte holds label 200 (sample 17)" in line and "classes are 0-9" in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_every_loaders_labels_are_checked_a_plugins_leafs_and_hf(tmp_path):
    from raysim.data.datasets import FederatedData

    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ConfigError, match=r"'mine': its test labels holds label -1 \(sample 2\)"):
        FederatedData("mine", x, np.array([0, 1, 2, 0]), x, np.array([0, 1, -1, 0]), 3)
    with pytest.raises(ConfigError, match="labels of type float64"):
        FederatedData("mine", x, np.array([0, 1.5, 2, 0]), x, np.array([0, 1, 1, 0]), 3)
    # LEAF: a float label is named with its user (it was truncated to an int before)
    from test_leaf import femnist_users, write_leaf

    rng = np.random.default_rng(0)
    write_leaf(tmp_path, "femnist", femnist_users(rng, 3, 4, lambda i, j: 2.5 if (i, j) == (1, 2) else j),
               femnist_users(rng, 3, 2, lambda i, j: j))
    cfg = load_config(overrides=["dataset=femnist", f"data_dir={tmp_path}", "num_clients=3", "model=mlp"])
    from raysim.data.datasets import load_dataset

    with pytest.raises(ConfigError, match=r"label 2\.5; labels are class ids"):
        load_dataset(cfg)
    # hf: a ClassLabel's -1 (no label) and a column of non-integer numbers
    datasets = pytest.importorskip("datasets")
    cl = datasets.Features({"x": datasets.Value("float32"), "label": datasets.ClassLabel(names=["a", "b"])})
    for split, labels in (("train", [0, 1, 0, 1]), ("test", [0, -1, -1, 1])):
        datasets.Dataset.from_dict({"x": [0.0, 1.0, 2.0, 3.0], "label": labels}, features=cl).to_parquet(
            str(tmp_path / "cl" / f"{split}.parquet"))
    for split, labels in (("train", [0.0, 0.37, 1.0, 2.0]), ("test", [0.0, 1.0, 2.0, 1.0])):
        datasets.Dataset.from_dict({"x": [0.0, 1.0, 2.0, 3.0], "label": labels}).to_parquet(
            str(tmp_path / "fl" / f"{split}.parquet"))
    for folder, says in (("cl", "2 samples of the test split have no label (-1"), ("fl", "non-integer numbers (e.g. 0.37)")):
        cfg = load_config(overrides=["dataset=hf", f"hf.path={tmp_path / folder}", f"data_dir={tmp_path}"])
        with pytest.raises(ConfigError) as e:
            load_dataset(cfg)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_tracker_that_cannot_open_is_one_line_and_leaves_no_run_directory(ray_local, tmp_path, capfd):
    """Through the CLI's entry point on the session's Ray (the same path as a subprocess, less
    a Ray start)."""
    pytest.importorskip("mlflow")
    from raysim.run import main

    code = main([*SMALL, "log.mlflow=true", "log.mlflow_uri=bogus://x", f"output_dir={tmp_path / 'out'}", "run_name=t"])
    err = [line for line in capfd.readouterr().err.strip().splitlines() if not line.startswith("raysim [")]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "log.mlflow=true: the tracker did not open" in err[0] and "bogus://x" in err[0], err[0]
    assert not (tmp_path / "out" / "t").exists()


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_line_in_the_log(tmp_path):
    pytest.importorskip("tensorboard")
    from raysim.runtime.writer import RunWriter

    cfg = {"log": {"tensorboard": True}, "output_dir": str(tmp_path)}
    w = RunWriter(tmp_path / "run", "rounds: 2\n", trackers=cfg)
    row = {"round": 1, "accuracy": 0.5, "clients": 2, "dropped": 0, "seconds": 0.1}
    w.round(dict(row), [])

    def broken(*a, **k):
        raise OSError("No space left on device")

    w.trackers.active[0][1].writer.add_scalar = broken
    w.round({**row, "round": 2}, [])  # the run goes on
    w.finish({"final_accuracy": 0.5}, None)
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "log.tensorboard: the tracker failed in round 2 (OSError: No space left on device)" in log
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_accuracy"] == 0.5


def test_zero_cpus_per_actor_is_bounded_and_the_log_says_why(ray_local, tmp_path):
    """On the session's Ray (4 CPUs): 12 clients get 4 actors, not 12, and the log says why."""
    from raysim.run import main

    assert main([*SMALL, "num_clients=12", "resources.num_cpus_per_actor=0", f"output_dir={tmp_path}",
                 "run_name=z"]) == 0
    line = next(l for l in (tmp_path / "z" / "log.txt").read_text().splitlines() if "client actors" in l)
    assert line.split(" ", 1)[1].startswith("4 client actors") and "num_cpus_per_actor=0 bounds nothing" in line, line


def test_a_warm_service_of_another_version_is_one_line(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        d = tmp_path / "service"
        d.mkdir()
        (d / "address").write_text(f"127.0.0.1:{srv.getsockname()[1]}")
        (d / "version").write_text("raysim 0.0.9 (service format 0), Ray 2.40.0, Python 3.11")
        env = dict(os.environ, RAYSIM_SERVICE_DIR=str(d))
        r = cli([*SMALL, f"output_dir={tmp_path / 'out'}"], tmp_path, env=env)
        line = one_error_line(r)
        assert "was started by raysim 0.0.9" in line and "python -m raysim.down" in line, line
        assert not (tmp_path / "out").exists()
        (d / "version").unlink()  # a service from before the version file
        assert "writes no version file" in one_error_line(cli([*SMALL, f"output_dir={tmp_path / 'out'}"], tmp_path,
                                                              env=env))
    finally:
        srv.close()


def test_a_plugin_an_earlier_run_imported_does_not_leak_into_a_later_runs_record(ray_local, tmp_path):
    """A run with a plugin dataset (bench_images) leaves the plugin registered in this
    process and in the reused server actor; a later run that neither uses nor names it must
    not record its section, or a fresh process could not resume it (found by the suite:
    `unknown config key 'bench_images'` on resume)."""
    from raysim.run import main

    out = f"output_dir={tmp_path}"
    assert main(["plugins=[bench_plugin]", "dataset=bench_images", "bench_images.samples_per_client=4",
                 "bench_images.test_samples=8", "partition=iid", "partition.min_size=1", "model=mclr", "num_clients=4",
                 "rounds=1", out, "run_name=with-plugin", "--quiet"]) == 0
    assert main(["num_clients=6", "rounds=2", out, "run_name=later", "--quiet"]) == 0
    later = tmp_path / "later"
    assert "bench_images" not in (later / "config.yaml").read_text()
    import torch

    record = torch.load(later / "checkpoint.pt", weights_only=False)["config"]
    assert not [k for k in record if k.startswith("bench_images.")]
    # a fresh process without the plugin reads the run's config back (as resume= does first)
    r = cli([f"resume={later}", "rounds=3", "--print-config"], tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0 and "rounds: 3" in r.stdout, r.stderr
