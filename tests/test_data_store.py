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


def test_rows_read_in_place_equal_indexing_and_hashes_made_while_writing_equal_the_files(tmp_path):
    """`Rows.take` (positioned reads, runs of consecutive rows, segments of files) gives what
    numpy indexing gives, in the order asked; a generator's files are hashed as written."""
    import numpy as np

    from raysim.data import store

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 2, 5), dtype=np.float32)
    w = store.Writer(tmp_path, "t")
    out = w.array("x_train", x.shape, x.dtype)
    for a in range(0, len(x), 700):  # in order, in chunks that do not divide the rows
        out[a:a + 700] = x[a:a + 700]
    w.put("y_train", np.arange(len(x)))
    manifest = w.finish()
    assert manifest["arrays"]["x_train"]["blocks"] == list(store._file_blocks(tmp_path / "t" / "x_train.npy").values())
    rows = store.Rows(manifest, "x_train")
    for idx in [rng.permutation(3000)[:500], np.arange(10, 2990), np.r_[7, 8, 9, 2999, 0, 1, 1], np.zeros(0, int)]:
        assert np.array_equal(rows.take(idx), x[idx])
    # the same rows as two segments of one file (an Arrow cache's record batches are such)
    entry = manifest["arrays"]["x_train"]
    path, at, row = str(tmp_path / "t" / "x_train.npy"), rows.offsets[0], rows.row
    two = {"arrays": {"x": store.outside([[path, int(at), 1000], [path, int(at + 1000 * row), 2000]], (2, 5),
                                         np.float32, 3000)}}
    split = store.StoredArray(two, "x")
    idx = rng.permutation(3000)
    assert np.array_equal(split[idx], x[idx]) and np.array_equal(np.asarray(split), x) and split.shape == x.shape
    assert entry["shape"] == [3000, 2, 5]


def test_data_the_disk_has_no_room_for_are_one_line_before_anything_is_written(ray_local, tmp_path, capfd):
    """bench_images with more float32 3x32x32 samples than the test's disk has room for:
    data_store=auto picks files (they would crowd any object store), and the disk has no room:
    one line naming the folder, the size and what is free; no run directory, no file."""
    import shutil

    per_client = 500 * (3 * 32 * 32 * 4 + 8)  # bytes: 500 samples and their labels
    clients = (shutil.disk_usage(tmp_path).free + 2 * 2**30) // per_client + 1  # more than the disk holds
    common = ["plugins=[bench_plugin]", "dataset=bench_images", "bench_images.dtype=float32", "model=cnn",
              f"num_clients={clients}", "partition=iid", "rounds=1", f"output_dir={tmp_path / 'runs'}",
              f"data_store_dir={tmp_path / 'arrays'}", "--quiet"]
    capfd.readouterr()
    assert main(common) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    need = f"the training data need {clients * per_client / 2**30:.1f} GB under {tmp_path / 'arrays'}, whose disk has"
    assert len(err) == 1 and need in err[0] and "GB free" in err[0] and "data_store_dir" in err[0], err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "arrays").exists()


def test_a_stored_array_missing_on_this_host_says_which_host_and_what_to_do(tmp_path):
    """What a worker host that does not share data_store_dir meets (tests/test_cluster_hosts.py
    saw it): one line naming the file, the host, and the two ways out."""
    import socket

    import numpy as np

    from raysim.config import ConfigError
    from raysim.data import store

    files = store.put({"x_train": np.zeros((4, 2), np.float32)}, tmp_path)
    (Path(files["folder"]) / "x_train.npy").unlink()
    with pytest.raises(ConfigError) as e:
        store.open_arrays(files)
    text = str(e.value)
    assert f"x_train.npy is not there on host {socket.gethostname()}" in text and "\n" not in text
    assert "data_store=memory" in text and "shared mount" in text


def test_a_host_without_the_folder_copies_the_files_from_the_writers_node_checked_block_by_block(ray_local, tmp_path,
                                                                                                  monkeypatch):
    """data/replicate.py's copy, over Ray from the node that wrote the files (here this
    node, into another folder; tests/test_cluster_hosts.py does it across hosts): the same
    bytes, each block checked, made once; a file changed on the writer's side is one line."""
    import numpy as np

    from raysim.data import replicate, store

    monkeypatch.setattr(store, "BLOCK", 2**20)  # several blocks, and pieces of a quarter block
    monkeypatch.setattr(replicate, "PIECE", 2**18)
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 255, (5000, 700), dtype=np.uint8), "y_train": np.arange(5000)}
    manifest = {**store.put(arrays, tmp_path / "head"), "node": ray_local.get_runtime_context().get_node_id()}
    name = Path(manifest["folder"]).name
    entries = {n: e for n, e in manifest["arrays"].items()}
    assert len(entries["x_train"]["blocks"]) == 4  # 3.5 MB in 1 MB blocks
    local = replicate._copy(manifest, entries, tmp_path / "worker")
    assert local["folder"] == str((tmp_path / "worker" / name).resolve())
    got = store.open_arrays(store.find(tmp_path / "worker", name))
    assert all(np.array_equal(got[k], arrays[k]) for k in arrays)
    assert not [p for p in (tmp_path / "worker").iterdir() if p.name.startswith(f".{name}-")]  # no temporary left
    # the writer's file changed since: the copy is refused, and none is left half-made
    with open(Path(manifest["folder"]) / "x_train.npy", "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"x" * 10)
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="no longer holds what raysim wrote"):
        replicate._copy(manifest, entries, tmp_path / "again")
    assert not list((tmp_path / "again").iterdir())
