"""`data_store=files` (raysim/data/store.py): the training arrays written once as memory-mapped
files that every process reads, instead of Ray's object store. Models bit-identical to the
memory path; files changed or truncated since they were written are one line, not wrong data."""
import os
from pathlib import Path

import pytest
import torch

from raysim.run import main


def _model(path: Path) -> dict:
    return torch.load(path / "model.pt", weights_only=True)["global"]


@pytest.mark.parametrize("extra", [["algorithm=fedavg"], ["model=mclr", "local.vectorize=true", "local.vectorize_group=3"],
                                   ["algorithm=scaffold"]], ids=["fedavg", "vectorised", "scaffold-client-state"])
def test_memory_mapped_files_give_the_models_of_the_object_store(ray_local, tmp_path, extra):
    common = ["dataset=digits", "num_clients=8", "participation=0.75", "rounds=3", f"output_dir={tmp_path}",
              "--quiet", *extra]
    store = tmp_path / "arrays"
    assert main([*common, "run_name=memory"]) == 0
    assert main([*common, "run_name=files", "data_store=files", f"data_store_dir={store}"]) == 0
    a, b = _model(tmp_path / "memory"), _model(tmp_path / "files")
    assert all(torch.equal(a[k], b[k]) for k in a)
    (folder,) = [p for p in store.iterdir() if not p.name.startswith(".")]
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "x_train.npy", "y_train.npy"]
    written = (folder / "x_train.npy").stat().st_mtime_ns
    assert main([*common, "run_name=again", "data_store=files", f"data_store_dir={store}"]) == 0  # found, not rewritten
    assert (folder / "x_train.npy").stat().st_mtime_ns == written
    c = _model(tmp_path / "again")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_stored_file_truncated_or_changed_since_is_one_line_and_no_run(ray_local, tmp_path, capfd):
    common = ["dataset=digits", "num_clients=6", "rounds=1", f"output_dir={tmp_path}", "data_store=files",
              f"data_store_dir={tmp_path / 'arrays'}", "--quiet"]
    assert main([*common, "run_name=first"]) == 0
    (folder,) = [p for p in (tmp_path / "arrays").iterdir() if not p.name.startswith(".")]
    x = folder / "x_train.npy"
    original = x.read_bytes()
    for name, damage, says in [("truncated", lambda b: b[:-100], "cannot be read as an array"),
                               ("changed", lambda b: b[:-7] + bytes([b[-7] ^ 1]) + b[-6:], "its content differs")]:
        x.write_bytes(damage(original))
        capfd.readouterr()
        assert main([*common, f"run_name={name}"]) == 2
        err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and str(x) in err[0] and says in err[0] and "delete the folder" in err[0], err
        assert not (tmp_path / name).exists()
    x.write_bytes(original)
    os.utime(x)
    assert main([*common, "run_name=repaired"]) == 0


def test_a_generator_writes_its_arrays_straight_into_files_once_with_the_memory_paths_values(ray_local, tmp_path):
    """bench_images makes its arrays in chunks (`generate`): with data_store=files they go
    straight into files, once per key (a second run finds them), never held whole; the
    models equal the memory path's, also when a long tail takes a subset of the stored arrays."""
    store = tmp_path / "arrays"
    common = ["plugins=[bench_plugin]", "dataset=bench_images", "bench_images.samples_per_client=12",
              "bench_images.dtype=float32", "bench_images.test_samples=40", "model=cnn", "partition=iid",
              "partition.min_size=1", "num_clients=8", "rounds=2", f"output_dir={tmp_path}",
              f"data_store_dir={store}", "--quiet"]
    for name, extra in [("m", ["data_store=memory"]), ("f", ["data_store=files"]), ("f2", ["data_store=files"]),
                        ("lt-m", ["data_store=memory", "long_tail.imbalance=4"]),
                        ("lt-f", ["data_store=files", "long_tail.imbalance=4"])]:
        assert main([*common, *extra, f"run_name={name}"]) == 0
        if name == "f":
            (folder,) = [p for p in store.iterdir() if p.name.startswith("bench_images-")]
            written = (folder / "x_train.npy").stat().st_mtime_ns
    assert (folder / "x_train.npy").stat().st_mtime_ns == written  # found by the later runs, not made again
    assert len([p for p in store.iterdir() if p.name.startswith("bench_images-")]) == 1  # (the long tail's subset:
    # a folder of its own, named by its content)
    for a, b in [("m", "f"), ("m", "f2"), ("lt-m", "lt-f")]:
        x, y = _model(tmp_path / a), _model(tmp_path / b)
        assert all(torch.equal(x[k], y[k]) for k in x), (a, b)
    lt, full = _model(tmp_path / "lt-m"), _model(tmp_path / "m")
    assert not all(torch.equal(lt[k], full[k]) for k in lt)  # the long tail did train on other data
