"""Loaders read small files that the test writes in each dataset's own format."""
import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import torch
import pytest

from raysim.config import ConfigError, load_config
from raysim.data.datasets import load_dataset


def write_idx(path, arr, gz=False):
    """IDX format: magic (0, 0, dtype 0x08 = ubyte, ndim), big-endian dims, raw bytes."""
    data = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()
    opener = gzip.open if gz else open
    with opener(str(path) + (".gz" if gz else ""), "wb") as f:
        f.write(data)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fmnist", "FashionMNIST")])
def test_idx_loader(tmp_path, name, folder, gz):
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    xtr, ytr = rng.integers(0, 256, (50, 28, 28)), rng.integers(0, 10, 50)
    xte, yte = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 10, 20)
    write_idx(raw / "train-images-idx3-ubyte", xtr, gz)
    write_idx(raw / "train-labels-idx1-ubyte", ytr, gz)
    write_idx(raw / "t10k-images-idx3-ubyte", xte, gz)
    write_idx(raw / "t10k-labels-idx1-ubyte", yte, gz)
    d = load_dataset(load_config(overrides=[f"dataset={name}", f"data_dir={tmp_path}", "download=false"]))
    assert d.x_train.shape == (50, 1, 28, 28) and d.x_test.shape == (20, 1, 28, 28)
    assert d.x_train.dtype == np.uint8 and np.array_equal(d.x_train[:, 0], xtr)  # stored as the file's pixels
    assert np.array_equal(d.y_train, ytr) and np.array_equal(d.y_test, yte)
    # what models take: float32 (pixel / 255 - mean) / std, exactly the numpy arithmetic
    mean, std = np.float32(0.1307 if name == "mnist" else 0.2860), np.float32(0.3081 if name == "mnist" else 0.3530)
    want = (xtr.astype(np.float32)[:, None] / np.float32(255.0) - mean) / std
    got = d.inputs(d.x_train)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


def write_cifar(folder, files, n, label_keys, rng):
    folder.mkdir(parents=True)
    truth = {}
    for f in files:
        entry = {"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8)}
        for key, classes in label_keys.items():
            entry[key] = rng.integers(0, classes, n).tolist()
        truth[f] = entry
        with open(folder / f, "wb") as fh:
            pickle.dump(entry, fh)
    return truth


def test_cifar10_pickle_loader(tmp_path):
    rng = np.random.default_rng(1)
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    truth = write_cifar(tmp_path / "cifar-10-batches-py", files, 8, {"labels": 10}, rng)
    d = load_dataset(load_config(overrides=["dataset=cifar10", f"data_dir={tmp_path}", "download=false"]))
    assert d.x_train.shape == (40, 3, 32, 32) and d.x_test.shape == (8, 3, 32, 32)
    assert d.y_train.tolist() == sum((truth[f]["labels"] for f in files[:5]), [])
    # channel-first: the red plane is the first 1024 bytes of a CIFAR row
    red = truth["test_batch"]["data"][0, :1024].reshape(32, 32)
    assert np.argmax(d.x_test[0, 0].ravel()) == np.argmax(red.ravel())
    # input_scale=unit: NIID-Bench's / FedConcat's [0, 1] pixels, exactly byte / 255
    u = load_dataset(load_config(overrides=["dataset=cifar10", f"data_dir={tmp_path}", "download=false",
                                            "input_scale=unit"]))
    assert np.array_equal(u.inputs(u.x_test)[0, 0].numpy(), red.astype(np.float32) / np.float32(255.0))
    assert u.norm == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert abs(float(d.inputs(d.x_test).mean())) < abs(float(u.inputs(u.x_test).mean()))  # standardised: about zero-mean


@pytest.mark.parametrize("coarse", [False, True])
def test_cifar100_fine_and_coarse(tmp_path, coarse):
    rng = np.random.default_rng(2)
    truth = write_cifar(tmp_path / "cifar-100-python", ["train", "test"], 12,
                        {"fine_labels": 100, "coarse_labels": 20}, rng)
    d = load_dataset(load_config(overrides=["dataset=cifar100", f"cifar100.coarse={coarse}",
                                            f"data_dir={tmp_path}", "download=false"]))
    key = "coarse_labels" if coarse else "fine_labels"
    assert d.y_train.tolist() == truth["train"][key] and d.y_test.tolist() == truth["test"][key]
    assert d.num_classes == (20 if coarse else 100)


def _idx_four(folder, rng, gz, n=(50, 20)):
    """The four IDX files flat in `folder` (Debian's layout); returns their arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = [rng.integers(0, 256, (n[0], 28, 28)), rng.integers(0, 10, n[0]),
              rng.integers(0, 256, (n[1], 28, 28)), rng.integers(0, 10, n[1])]
    for name, a in zip(["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                        "t10k-labels-idx1-ubyte"], arrays):
        write_idx(folder / name, a, gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_idx_files_flat_in_data_dir_load_and_nothing_is_written_there(tmp_path, gz):
    """The four files flat in `data_dir`, as Debian lays them out, load as the torchvision
    layout does, and the folder is only read (a system folder is read-only)."""
    xtr, ytr, xte, yte = _idx_four(tmp_path / "flat", np.random.default_rng(4), gz)
    before = sorted(p.name for p in (tmp_path / "flat").iterdir())
    d = load_dataset(load_config(overrides=["dataset=fmnist", f"data_dir={tmp_path / 'flat'}", "download=false"]))
    assert np.array_equal(d.x_train[:, 0], xtr) and np.array_equal(d.y_train, ytr)
    assert np.array_equal(d.x_test[:, 0], xte) and np.array_equal(d.y_test, yte) and d.y_test.dtype == np.int64
    assert sorted(p.name for p in (tmp_path / "flat").iterdir()) == before


def test_fmnist_without_data_dir_reads_the_system_copy_and_names_bad_files(tmp_path, monkeypatch):
    """No copy under `data_dir`: Fashion-MNIST comes from the system's folder (Debian's
    dataset-fashion-mnist; here a folder of small files in its place). A truncated file
    there is named in one message; with no copy anywhere, the message says how to get one."""
    from raysim.data import datasets

    system = tmp_path / "usr-share-datasets-fashion-mnist"
    xtr, ytr, _, _ = _idx_four(system, np.random.default_rng(5), gz=True)
    monkeypatch.setitem(datasets.SYSTEM_IDX_FOLDERS, "fmnist", system)
    cfg = load_config(overrides=["dataset=fmnist", f"data_dir={tmp_path / 'empty'}", "download=false"])
    d = load_dataset(cfg)
    assert np.array_equal(d.x_train[:, 0], xtr) and np.array_equal(d.y_train, ytr)
    assert d.label_source[0] == system / "train-labels-idx1-ubyte.gz"
    (tmp_path / "empty" / "FashionMNIST" / "raw").mkdir(parents=True)  # a download that left nothing is no copy
    assert np.array_equal(load_dataset(cfg).y_train, ytr)
    with pytest.raises(ConfigError, match="download=false"):  # MNIST has no system copy
        load_dataset(load_config(overrides=["dataset=mnist", f"data_dir={tmp_path / 'empty'}", "download=false"]))
    labels = system / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(gzip.decompress(labels.read_bytes())[:-3]))
    with pytest.raises(ConfigError, match=f"{labels} is not a whole IDX file of bytes .*fetch it again"):
        load_dataset(cfg)
    monkeypatch.setitem(datasets.SYSTEM_IDX_FOLDERS, "fmnist", tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="apt install dataset-fashion-mnist"):
        load_dataset(cfg)


FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FASHION.is_dir(), reason="Debian's dataset-fashion-mnist is not installed "
                                                  "(apt install dataset-fashion-mnist; .ci/run installs it)")
def test_the_real_fashion_mnist_from_debians_package(tmp_path):
    """With the package installed and no data_dir of the user's: the whole Fashion-MNIST,
    60,000 training and 10,000 test images, 6,000 and 1,000 of each class."""
    d = load_dataset(load_config(overrides=["dataset=fmnist", f"data_dir={tmp_path}", "download=false"]))
    assert d.x_train.shape == (60000, 1, 28, 28) and d.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(d.y_train).tolist() == [6000] * 10 and np.bincount(d.y_test).tolist() == [1000] * 10
    assert str(d.label_source[0]).startswith(str(FASHION)) and not any(tmp_path.iterdir())


def test_missing_files_name_the_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"MNIST/raw.*train-images-idx3-ubyte"):
        load_dataset(load_config(overrides=["dataset=mnist", f"data_dir={tmp_path}", "download=false"]))


def test_synthetic_natural_users():
    cfg = load_config(overrides=["dataset=synthetic", "partition=natural", "num_clients=7", "synthetic.samples_per_client=50"])
    d = load_dataset(cfg)
    assert d.x_train.shape == (7 * 40, 60) and d.x_test.shape == (7 * 10, 60)
    assert np.bincount(d.users_train).tolist() == [40] * 7
    assert set(np.unique(d.y_train)) <= set(range(10))
    again = load_dataset(cfg)
    assert np.array_equal(d.x_train, again.x_train)


def test_svhn_mat_loader(tmp_path):
    """SVHN's .mat format: X is (32, 32, 3, N) uint8, y is (N, 1) with the digit 0 stored as 10."""
    from scipy.io import savemat

    rng = np.random.default_rng(3)
    truth = {}
    for split, n in (("train", 12), ("test", 5)):
        x = rng.integers(0, 256, (32, 32, 3, n)).astype(np.uint8)
        y = rng.integers(1, 11, (n, 1))
        savemat(tmp_path / f"{split}_32x32.mat", {"X": x, "y": y})
        truth[split] = (x, y.ravel() % 10)
    d = load_dataset(load_config(overrides=["dataset=svhn", f"data_dir={tmp_path}", "download=false"]))
    assert d.x_train.shape == (12, 3, 32, 32) and d.x_test.shape == (5, 3, 32, 32)
    assert d.y_train.tolist() == truth["train"][1].tolist() and d.y_test.tolist() == truth["test"][1].tolist()
    x0 = truth["train"][0][:, :, 0, 0]  # the red plane of the first image
    assert np.argmax(d.x_train[0, 0].ravel()) == np.argmax(x0.ravel())


def test_cinic10_folder_loader(tmp_path):
    from PIL import Image

    from raysim.data.datasets import CINIC_CLASSES

    rng = np.random.default_rng(4)
    first = {}
    for split, per_class in (("train", 2), ("test", 1)):
        for label, name in enumerate(CINIC_CLASSES):
            folder = tmp_path / "cinic10" / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                img = rng.integers(0, 256, (32, 32, 3)).astype(np.uint8)
                Image.fromarray(img).save(folder / f"cifar10-{split}-{i}.png")
                first.setdefault((split, label), img)
    d = load_dataset(load_config(overrides=["dataset=cinic10", f"data_dir={tmp_path}"]))
    assert d.x_train.shape == (20, 3, 32, 32) and d.x_test.shape == (10, 3, 32, 32)
    assert sorted(d.y_train.tolist()) == sorted(list(range(10)) * 2) and sorted(d.y_test.tolist()) == list(range(10))
    k = int(np.flatnonzero(d.y_test == 3)[0])  # PNG is lossless: the red plane's brightest pixel survives
    assert np.argmax(d.x_test[k, 0].ravel()) == np.argmax(first[("test", 3)][:, :, 0].ravel())


def test_cinic10_missing_folder_says_where(tmp_path):
    with pytest.raises(ConfigError, match=r"cinic10.*train, test not found under"):
        load_dataset(load_config(overrides=["dataset=cinic10", f"data_dir={tmp_path}"]))


def _mnist_files(raw, rng, gz=True):
    raw.mkdir(parents=True, exist_ok=True)
    for f, shape in (("train-images-idx3-ubyte", (30, 28, 28)), ("train-labels-idx1-ubyte", (30,)),
                     ("t10k-images-idx3-ubyte", (10, 28, 28)), ("t10k-labels-idx1-ubyte", (10,))):
        write_idx(raw / f, rng.integers(0, 10, shape), gz)


def test_corrupt_idx_files_are_named_and_leave_nothing_behind(tmp_path):
    """A non-gzip .gz, a truncated .gz and a whole gzip of truncated IDX data each give one
    message naming the file and leave no unpacked (or partly unpacked) file; once the .gz is
    fixed the dataset loads."""
    raw = tmp_path / "MNIST" / "raw"
    rng = np.random.default_rng(0)
    cfg = load_config(overrides=["dataset=mnist", f"data_dir={tmp_path}", "download=false"])
    gz = raw / "train-images-idx3-ubyte.gz"
    _mnist_files(raw, rng)
    good = gz.read_bytes()
    header = struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">3I", 30, 28, 28)
    for bad, message in ((b"<html>not found</html>", "is not a whole gzip file"),
                         (good[: len(good) // 2], "is not a whole gzip file"),
                         (gzip.compress(header + bytes(100)), r"is corrupt or truncated \(its header says 23536 bytes, it has 116")):
        gz.write_bytes(bad)
        with pytest.raises(ConfigError, match=message) as e:
            load_dataset(cfg)
        assert str(gz) in str(e.value)
        assert sorted(p.name for p in raw.iterdir() if "train-images" in p.name) == [gz.name]  # nothing left
    gz.write_bytes(good)
    assert load_dataset(cfg).x_train.shape == (30, 1, 28, 28)
    out = raw / "train-images-idx3-ubyte"  # an extracted file cut short is named too
    out.write_bytes(out.read_bytes()[:-5])
    with pytest.raises(ConfigError, match=f"{out} is corrupt or truncated"):
        load_dataset(cfg)


def test_synthetic_sizes_drawn_in_a_range():
    import numpy as np

    from raysim.config import ConfigError, load_config
    from raysim.data.datasets import Synthetic

    base = ["dataset=synthetic", "partition=natural", "model=mclr", "num_clients=300", "synthetic.samples_per_client=20"]
    cfg = load_config(overrides=[*base, "synthetic.max_samples_per_client=200"])
    sizes = Synthetic.sizes(cfg, np.random.default_rng([0, 7]))
    assert sizes.min() >= 20 and sizes.max() <= 200 and len(set(sizes.tolist())) > 50
    data = Synthetic.load(cfg)  # the load draws the same sizes: 80 % of each user's samples train
    assert abs(len(data.x_train) + len(data.x_test) - int(sizes.sum())) == 0
    with pytest.raises(ConfigError, match="max_samples_per_client=10 must be above"):
        load_config(overrides=[*base, "synthetic.max_samples_per_client=10"])
    # alone, a cap on FedProx's log-normal sizes (it used to be ignored: users of 2,619 samples)
    fedprox = ["dataset=synthetic", "partition=natural", "model=mclr", "num_clients=300"]
    uncapped = Synthetic.sizes(load_config(overrides=fedprox), np.random.default_rng([0, 7]))
    capped = Synthetic.sizes(load_config(overrides=[*fedprox, "synthetic.max_samples_per_client=100"]),
                             np.random.default_rng([0, 7]))
    assert uncapped.max() > 1000 and (capped == np.minimum(uncapped, 100)).all()


def test_digits_split_is_kept_between_commands_and_equals_scikit_learns(tmp_path, monkeypatch):
    """The digits split read back from the cache (data/cache.py) is the one scikit-learn
    makes; each seed has its own file; a damaged file is made again; a read-only cache
    folder only means nothing is kept."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    monkeypatch.setenv("RAYSIM_CACHE_DIR", str(tmp_path / "cache"))
    d = load_digits()
    x, y = d.images.astype(np.uint8)[:, None], d.target.astype(np.int64)
    for seed in (0, 3):
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
        made = load_dataset(load_config(overrides=[f"seed={seed}"]))  # made, then written
        kept = load_dataset(load_config(overrides=[f"seed={seed}"]))  # read back
        for data in (made, kept):
            assert np.array_equal(data.x_train, xtr) and np.array_equal(data.y_train, ytr)
            assert np.array_equal(data.x_test, xte) and np.array_equal(data.y_test, yte)
    files = sorted((tmp_path / "cache").glob("digits-*.npz"))
    assert len(files) == 2 and not list((tmp_path / "cache").glob(".*"))  # no temp file left
    files[0].write_bytes(b"not a zip file")
    again = load_dataset(load_config(overrides=["seed=0"]))
    assert again.x_train.shape == made.x_train.shape and files[0].stat().st_size > 100  # made and written again

    monkeypatch.setenv("RAYSIM_CACHE_DIR", str(tmp_path / "cache-under-a-file" / "x"))
    (tmp_path / "cache-under-a-file").write_text("a file, not a folder")
    fresh = load_dataset(load_config(overrides=["seed=3"]))
    assert np.array_equal(fresh.y_train, kept.y_train)


def test_synthetic_per_user_makes_each_users_data_from_its_own_stream():
    """`synthetic.generate=per_user` (issue 73): user k's samples come from (seed, 7, k) alone,
    so a client's data can be made by itself, when it is picked, with the bits the whole
    dataset has for it."""
    import numpy as np

    from raysim.config import load_config
    from raysim.data.datasets import Synthetic

    cfg = load_config(overrides=["dataset=synthetic", "partition=natural", "model=mclr", "num_clients=40",
                                 "synthetic.generate=per_user"])
    data = Synthetic.load(cfg)
    sizes = Synthetic.sizes(cfg, np.random.default_rng([0, 7]))
    for k in (0, 17, 39):
        x, y = Synthetic.user(cfg, k, sizes[k])
        cut = sizes[k] - int(sizes[k] * 0.2)
        assert np.array_equal(data.x_train[data.users_train == k], x[:cut])
        assert np.array_equal(data.y_train[data.users_train == k], y[:cut])
        assert np.array_equal(data.x_test[data.users_test == k], x[cut:])
    assert len(np.unique(data.y_train)) >= 8  # each user's own model labels its samples: many classes overall
    other = Synthetic.load(load_config(overrides=["dataset=synthetic", "partition=natural", "model=mclr",
                                                  "num_clients=40"]))
    assert other.x_train.shape == data.x_train.shape and not np.array_equal(other.x_train, data.x_train)
