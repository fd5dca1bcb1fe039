"""Dataset loaders: each returns whole train/test arrays, ready to go to the object store.

Images come back as their uint8 pixels (N, C, H, W): a quarter of float32's memory in the
object store and in every transfer. `FederatedData.inputs` (and `model_inputs` where the
arrays are shared, on the device that trains) turns them into what models take: float32
standardised per channel with the dataset's mean and std (`input_scale: standardize`), or
pixels in [0, 1] (`input_scale: unit`, what NIID-Bench, FedConcat's and MOON's code train
on). Other features (Synthetic, Sent140) are stored as models take them. Labels are int64. Loaders
use torchvision's classes and file formats where torchvision has the dataset, reading from
`data_dir` (torchvision's own folder layout) and downloading when allowed and online.
A file that is missing offline gives a `ConfigError` saying which file and where to put it.
"""
from __future__ import annotations

import gzip
import os
import pickle
import shutil
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
from omegaconf import DictConfig

from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.registry import DATASETS

if TYPE_CHECKING:  # torch is imported where images are decoded, not by every loader's caller
    import torch

    from raysim.data.population import Population


LAZY_SCAN_LIMIT = 100_000  # users of a lazy population a selection that reads every client may take


@dataclass
class FederatedData:
    """A dataset as whole arrays, plus the natural owner of each sample where it has one."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    users_train: Optional[np.ndarray] = None  # natural partition: owner id of each train sample
    users_test: Optional[np.ndarray] = None
    norm: Optional[tuple] = None  # per-channel (mean, std) the images are standardised with
    pixel_max: Optional[float] = None  # images: x_* hold uint8 pixels in [0, pixel_max]
    label_source: Optional[tuple] = None  # (train, test): the files (or column) the labels came from, for messages
    stored: Optional[dict] = None  # data_store=files: the manifest of the files x_train / y_train map (data/store.py)
    global_test: Optional[np.ndarray] = None  # rows of x_test that make the global test set (None: all of them)
    population: Optional["Population"] = None  # users made when picked: x_train / y_train are its LazyRows

    def __post_init__(self) -> None:
        """Every loader's files, a plugin's arrays: samples and labels pair up, and every
        label is a class id 0..num_classes-1 (a label file of another dataset or a corrupt
        copy would otherwise fail later, in the partition or the loss, naming the wrong cause)."""
        for i, split in enumerate(("train", "test")):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(x) != len(y):
                raise ConfigError(f"dataset {self.name!r}: its {split} files hold {len(x):,} samples but {len(y):,} "
                                  "labels; they must come from the same copy of the dataset: fetch it again")
            if self.population is not None and split == "train":  # made when picked: checked as they are made
                continue
            check_labels(self.name, np.asarray(y), int(self.num_classes),
                         self.label_source[i] if self.label_source else f"its {split} labels")

    @property
    def input_shape(self) -> tuple:
        return tuple(self.x_train.shape[1:])

    def inputs(self, x) -> torch.Tensor:
        """Stored features (x_train / x_test rows) as the float tensor models take."""
        import torch

        return model_inputs(torch.as_tensor(x), self.pixel_max, self.norm)


def model_inputs(x: torch.Tensor, pixel_max: Optional[float], norm: Optional[tuple]) -> torch.Tensor:
    """uint8 pixels -> float32 (x / pixel_max - mean) / std per channel, on x's device (the
    same float32 arithmetic the loaders once did in numpy); features that are not pixels
    (pixel_max None) as they are."""
    if pixel_max is None:
        return x
    import torch

    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = torch.tensor(norm[0], dtype=torch.float32, device=x.device).view(shape)
    std = torch.tensor(norm[1], dtype=torch.float32, device=x.device).view(shape)
    return (x.float() / float(pixel_max) - mean) / std


def _scaling(cfg: DictConfig, mean: tuple, std: tuple) -> tuple:
    """The (mean, std) the images are scaled with: the dataset's, or 0 and 1 for [0, 1] pixels."""
    if cfg.input_scale == "unit":
        return tuple(0.0 for _ in mean), tuple(1.0 for _ in std)
    return mean, std


def _pixels(x_uint8: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W[, C]) -> uint8 (N, C, H, W), contiguous."""
    x = np.asarray(x_uint8, dtype=np.uint8)
    if x.ndim == 3:
        x = x[:, None]
    elif x.shape[-1] in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x)


_GET_IT = {"fmnist": "; or `apt install dataset-fashion-mnist` (Debian, Ubuntu): raysim reads it where it puts them"}


def _missing(name: str, where: Path, files: list[str], err: Exception | None) -> ConfigError:
    why = f" (download failed: {str(err).splitlines()[0][:120]})" if err else " (download=false)"
    return ConfigError(
        f"dataset {name!r}: files not found under {where}{why}; put {', '.join(files)} there "
        f"or set data_dir=<folder that has them>{_GET_IT.get(name, '')}"
    )


def _torchvision_load(name: str, cls, root: Path, download: bool, kwargs_train: dict, kwargs_test: dict,
                      where: Path, files: list[str]):
    """Build torchvision train/test datasets, trying a download only when files are missing."""
    def build(dl: bool):
        return cls(str(root), download=dl, **kwargs_train), cls(str(root), download=dl, **kwargs_test)

    try:
        return build(False)
    except (RuntimeError, FileNotFoundError, OSError):
        pass
    if not download:
        raise _missing(name, where, files, None)
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        return build(True)
    except Exception as e:  # network errors come in many types
        raise _missing(name, where, files, e) from None
    finally:
        socket.setdefaulttimeout(old)


# --------------------------------------------------------------------------- MNIST family
_IDX_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def _gunzip_if_needed(name: str, raw: Path) -> None:
    """Accept the distributed `.gz` IDX files as well as torchvision's extracted ones. A file
    is unpacked to a temporary name and renamed when whole, so a corrupt or truncated `.gz`
    leaves nothing behind (and is named); an extracted file must hold what its header says."""
    for f in _IDX_FILES:
        gz, out = raw / (f + ".gz"), raw / f
        if not out.exists() and gz.exists():
            tmp = raw / (f + ".part")
            try:
                with gzip.open(gz, "rb") as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, bad CRC
                tmp.unlink(missing_ok=True)
                raise ConfigError(f"dataset {name!r}: {gz} is not a whole gzip file ({type(e).__name__}: "
                                  f"{str(e)[:100] or 'truncated'}); fetch it again") from None
            _check_idx(name, tmp, gz)
            os.replace(tmp, out)
        elif out.exists():
            _check_idx(name, out, out)


def check_labels(name: str, y: np.ndarray, num_classes: int, where) -> None:
    """ConfigError naming `where` (a label file, a column) unless every label is an integer
    class id in [0, num_classes)."""
    if not y.size:
        return
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"dataset {name!r}: {where} holds labels of type {y.dtype} (e.g. {y.flat[0]!r}); labels "
                          f"are class ids 0-{num_classes - 1}")
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        first, more = int(np.argmax(bad)), int(bad.sum()) - 1
        raise ConfigError(f"dataset {name!r}: {where} holds label {int(y[first])} (sample {first:,}"
                          f"{f' and {more:,} more' if more else ''}); the dataset's classes are 0-{num_classes - 1} "
                          f"({num_classes}): a label file from another dataset or a corrupt copy? fetch it again")


def check_paired(name: str, x_file, n_x: int, y_file, n_y: int) -> None:
    """Samples and their labels read from two files must be as many: a label file cut short
    (or an image file from another copy) would otherwise pair images with wrong labels or
    train on the shorter one without a word."""
    if n_x != n_y:
        raise ConfigError(f"dataset {name!r}: {x_file} holds {n_x:,} samples but {y_file} holds {n_y:,} labels; "
                          "they must be the same split of the same copy: fetch both again")


IDX_ITEMSIZE = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}  # an IDX file's item types: bytes each


def _idx_shape(head: bytes, size: int, types: dict = IDX_ITEMSIZE) -> tuple[tuple, Optional[str]]:
    """An IDX file's shape from its first bytes (a 4-byte magic 0, 0, type, ndim, then ndim
    big-endian sizes) and its length in bytes, which must be the header's and exactly
    prod(sizes) items: (shape, None), or (shape or (), why it is no whole IDX file). Serves
    a file on disk (`_check_idx`) and one read into memory (`_read_idx`)."""
    ndim = head[3] if len(head) >= 4 else 0
    if len(head) < 4 + 4 * ndim or head[:2] != b"\0\0" or head[2] not in types:
        return (), f"no IDX header ({size:,} bytes)"
    shape = tuple(int(d) for d in np.frombuffer(head[4:4 + 4 * ndim], ">u4"))
    expected = 4 + 4 * ndim + types[head[2]] * int(np.prod(shape, dtype=np.int64))
    return shape, (None if size == expected else f"its header says {expected} bytes, it has {size}")


def _check_idx(name: str, path: Path, shown: Path) -> None:
    """A corrupt or truncated IDX file on disk: removed (unless it is the file the user
    gave, `shown`) and named."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        _, why = _idx_shape(fh.read(4 + 4 * 255), size)
    if why is not None:
        if path != shown:
            path.unlink(missing_ok=True)
        raise ConfigError(f"dataset {name!r}: {shown} is corrupt or truncated ({why}); delete it and fetch it again")


# Where the system keeps a dataset's four IDX files, flat: Debian's dataset-fashion-mnist
# (`apt install dataset-fashion-mnist`) puts Fashion-MNIST's in this folder.
SYSTEM_IDX_FOLDERS = {"fmnist": Path("/usr/share/datasets/fashion-mnist")}


def _flat_idx_files(folder: Path) -> Optional[list[Path]]:
    """The four IDX files lying flat in `folder` (each plain or .gz, the plain one first), or
    None when any is missing."""
    found = []
    for f in _IDX_FILES:
        here = [folder / f, folder / (f + ".gz")]
        hit = next((p for p in here if p.is_file()), None)
        if hit is None:
            return None
        found.append(hit)
    return found


def _read_idx(name: str, path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (.gz or not) read whole into memory, its header and size
    checked; nothing is written beside it (the system's folder is read-only)."""
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, bad CRC, unreadable
        raise ConfigError(f"dataset {name!r}: {path} cannot be read ({type(e).__name__}: "
                          f"{str(e)[:100] or 'truncated'}); fetch it again") from None
    shape, why = _idx_shape(data[:4 + 4 * 255], len(data), {0x08: 1})
    if why is not None:
        raise ConfigError(f"dataset {name!r}: {path} is not a whole IDX file of bytes ({why}); fetch it again")
    return np.frombuffer(data, np.uint8, offset=4 + 4 * len(shape)).reshape(shape)


def _idx_from_folder(name: str, files: list[Path], mean: float, std: float) -> FederatedData:
    """The dataset from its four IDX files lying flat in a folder (Debian's layout)."""
    xtr, ytr, xte, yte = (_read_idx(name, f) for f in files)
    for (x, xf), (y, yf) in (((xtr, files[0]), (ytr, files[1])), ((xte, files[2]), (yte, files[3]))):
        check_paired(name, xf, len(x), yf, len(y))
    return FederatedData(name, _pixels(xtr), ytr.astype(np.int64), _pixels(xte), yte.astype(np.int64), 10,
                         norm=((mean,), (std,)), pixel_max=255.0, label_source=(files[1], files[3]))


def _load_idx_family(name: str, folder: str, mean: float, std: float, cfg: DictConfig) -> FederatedData:
    """From `data_dir`: torchvision's layout (`<data_dir>/<folder>/raw`, `folder` the name of
    torchvision's class), else the four files flat in `data_dir`, else the system's copy
    (`SYSTEM_IDX_FOLDERS`), else torchvision's download into `<data_dir>/<folder>/raw`.
    torchvision (4-5 s to import with its models) is imported only for its layout."""
    root = Path(cfg.data_dir)
    (mean,), (std,) = _scaling(cfg, (mean,), (std,))
    raw = root / folder / "raw"
    if _flat_idx_files(raw) is None:  # no whole copy in torchvision's layout (an empty raw/ is none)
        for flat in (root, SYSTEM_IDX_FOLDERS.get(name)):
            files = _flat_idx_files(flat) if flat is not None else None
            if files is not None:
                return _idx_from_folder(name, files, mean, std)
    import torchvision.datasets

    cls = getattr(torchvision.datasets, folder)
    if raw.is_dir():
        _gunzip_if_needed(name, raw)
    train, test = _torchvision_load(name, cls, root, cfg.download, {"train": True}, {"train": False}, raw, _IDX_FILES)
    for ds, (images, labels) in ((train, _IDX_FILES[:2]), (test, _IDX_FILES[2:])):
        check_paired(name, raw / images, len(ds.data), raw / labels, len(ds.targets))
    return FederatedData(
        name,
        _pixels(train.data.numpy()),
        train.targets.numpy().astype(np.int64),
        _pixels(test.data.numpy()),
        test.targets.numpy().astype(np.int64),
        10,
        norm=((mean,), (std,)), pixel_max=255.0, label_source=(raw / _IDX_FILES[1], raw / _IDX_FILES[3]),
    )


@DATASETS.register("mnist")
class MNIST:
    """MNIST from IDX files in `<data_dir>/MNIST/raw` (torchvision layout; .gz accepted), or
    the four files flat in `data_dir`, else downloaded."""

    num_classes = 10

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        return _load_idx_family("mnist", "MNIST", 0.1307, 0.3081, cfg)


@DATASETS.register("fmnist")
class FMNIST:
    """Fashion-MNIST from IDX files in `<data_dir>/FashionMNIST/raw`, or flat in `data_dir`, or
    Debian's package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist), else downloaded."""

    num_classes = 10

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        return _load_idx_family("fmnist", "FashionMNIST", 0.2860, 0.3530, cfg)


# --------------------------------------------------------------------------- CIFAR family
def _cifar_classes():
    """torchvision's CIFAR classes, checking that files exist rather than their MD5, so
    that a locally prepared copy (or a test's small file) in the same format loads."""
    from torchvision.datasets import CIFAR10 as TV10, CIFAR100 as TV100

    class C10(TV10):
        def _check_integrity(self) -> bool:
            return all(os.path.isfile(os.path.join(self.root, self.base_folder, f)) for f, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:  # class names are not used; the meta file may be absent
            self.classes = []

    class C100(TV100):
        _check_integrity = C10._check_integrity
        _load_meta = C10._load_meta

    return C10, C100


def _cifar_data(name, tv_cls, folder, files, cfg, num_classes, label_key=None) -> FederatedData:
    root = Path(cfg.data_dir)
    train, test = _torchvision_load(name, tv_cls, root, cfg.download, {"train": True}, {"train": False}, root / folder, files)
    mean, std = _scaling(cfg, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    ys = []
    for ds, split in ((train, "train"), (test, "test")):
        if label_key is None:
            ys.append(np.asarray(ds.targets, np.int64))
        else:  # CIFAR-100 coarse labels sit in the same pickles as the fine ones
            with open(root / folder / split, "rb") as f:
                ys.append(np.asarray(pickle.load(f, encoding="latin1")[label_key], np.int64))
    where = (f"{root / folder}/{files[0] if len(files) == 2 else 'data_batch_*'}", root / folder / files[-1])
    return FederatedData(name, _pixels(train.data), ys[0], _pixels(test.data), ys[1],
                         num_classes, norm=(mean, std), pixel_max=255.0, label_source=where)


@DATASETS.register("cifar10")
class CIFAR10:
    """CIFAR-10 from the python pickles in `<data_dir>/cifar-10-batches-py`."""

    num_classes = 10

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        c10, _ = _cifar_classes()
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        return _cifar_data("cifar10", c10, "cifar-10-batches-py", files, cfg, 10)


@dataclass
class CIFAR100Options(Options):
    coarse: bool = False  # True: the 20 superclasses instead of the 100 fine classes


@DATASETS.register("cifar100")
class CIFAR100:
    """CIFAR-100 (fine, or the 20 coarse superclasses) from `<data_dir>/cifar-100-python`."""

    Options = CIFAR100Options
    num_classes = 100

    @staticmethod
    def classes(cfg: DictConfig) -> int:
        return 20 if cfg.cifar100.coarse else 100

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        _, c100 = _cifar_classes()
        coarse = bool(cfg.cifar100.coarse)
        return _cifar_data("cifar100", c100, "cifar-100-python", ["train", "test"], cfg,
                           20 if coarse else 100, "coarse_labels" if coarse else None)


@DATASETS.register("svhn")
class SVHN:
    """SVHN cropped digits from `<data_dir>/train_32x32.mat` and `test_32x32.mat`."""

    num_classes = 10

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        from torchvision.datasets import SVHN as TV

        class S(TV):
            def _check_integrity(self) -> bool:
                return os.path.isfile(os.path.join(self.root, self.filename))

        root = Path(cfg.data_dir)
        train, test = _torchvision_load("svhn", S, root, cfg.download, {"split": "train"}, {"split": "test"},
                                        root, ["train_32x32.mat", "test_32x32.mat"])
        mean, std = _scaling(cfg, (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))
        # torchvision keeps SVHN as (N, C, H, W) uint8 already
        return FederatedData("svhn", _pixels(train.data.transpose(0, 2, 3, 1)), train.labels.astype(np.int64),
                             _pixels(test.data.transpose(0, 2, 3, 1)), test.labels.astype(np.int64), 10,
                             norm=(mean, std), pixel_max=255.0,
                             label_source=(root / "train_32x32.mat", root / "test_32x32.mat"))


CINIC_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@dataclass
class CINIC10Options(Options):
    use_valid: bool = False  # also train on the `valid` split (90k more images)


@DATASETS.register("cinic10")
class CINIC10:
    """CINIC-10 in its standard folder layout: `<data_dir>/cinic10/{train,valid,test}/<class>/*.png`
    (32x32 RGB), read with torchvision's ImageFolder. It is not downloadable through
    torchvision: fetch and unpack it there yourself."""

    Options = CINIC10Options
    num_classes = 10

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        from torchvision.datasets import ImageFolder

        root = Path(cfg.data_dir) / "cinic10"
        splits = ["train", "valid", "test"] if cfg.cinic10.use_valid else ["train", "test"]
        missing = [s for s in splits if not (root / s).is_dir()]
        if missing:
            raise ConfigError(f"dataset 'cinic10': folder(s) {', '.join(missing)} not found under {root}; "
                              f"unpack CINIC-10 there ({'/'.join(splits)}/<class>/*.png) or set data_dir=...")
        arrays = {}
        for split in splits:
            folder = ImageFolder(str(root / split))
            if folder.classes != CINIC_CLASSES:
                raise ConfigError(f"dataset 'cinic10': {root / split} has classes {folder.classes}, expected {CINIC_CLASSES}")
            x = np.stack([np.asarray(folder.loader(path).convert("RGB"), dtype=np.uint8) for path, _ in folder.samples])
            arrays[split] = (x, np.asarray(folder.targets, np.int64))
        train = [arrays[s] for s in splits if s != "test"]
        mean, std = _scaling(cfg, (0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587))
        return FederatedData("cinic10", _pixels(np.concatenate([t[0] for t in train])),
                             np.concatenate([t[1] for t in train]),
                             _pixels(arrays["test"][0]), arrays["test"][1], 10, norm=(mean, std),
                             pixel_max=255.0)


# --------------------------------------------------------------------------- offline data
@DATASETS.register("digits")
class Digits:
    """scikit-learn's 8x8 digits (1,797 images, shipped with the install): the offline
    default. A fixed 80/20 train/test split from `seed`. Pixels (0..16) scaled to [-1, 1],
    or to [0, 1] with `input_scale: unit`."""

    num_classes = 10

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        from importlib.metadata import version

        from raysim.data.cache import cached_arrays

        def split() -> dict:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            d = load_digits()
            x = d.images.astype(np.uint8)[:, None]  # pixels 0..16
            y = d.target.astype(np.int64)
            xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=cfg.seed, stratify=y)
            return {"x_train": np.ascontiguousarray(xtr), "y_train": ytr, "x_test": np.ascontiguousarray(xte),
                    "y_test": yte}

        # the split is kept between commands (data/cache.py): importing scikit-learn costs more than the run's start
        a = cached_arrays("digits", {"scikit-learn": version("scikit-learn"), "seed": int(cfg.seed), "test": 0.2},
                          split)
        mean, std = _scaling(cfg, (0.5,), (0.5,))
        return FederatedData("digits", a["x_train"], a["y_train"], a["x_test"], a["y_test"], 10,
                             norm=(mean, std), pixel_max=16.0)


@dataclass
class SyntheticOptions(Options):
    alpha: float = option(1.0, at_least=0)  # how much local models differ
    beta: float = option(1.0, at_least=0)  # how much local inputs differ
    dim: int = option(60, at_least=1)
    num_classes: int = option(10, at_least=2)
    samples_per_client: int = option(0, at_least=0)  # 0: FedProx's log-normal sizes; > 0: this many per client
    max_samples_per_client: int = option(0, at_least=0)  # > samples_per_client: sizes uniform in [samples_per_client, this];
    # with samples_per_client 0: a cap on FedProx's log-normal sizes
    test_fraction: float = option(0.2, above=0, below=1)  # each user's share held out for the global test set
    generate: str = option("all", choices=("all", "per_user", "lazy"))  # all: one stream for every user | per_user:
    # user k's model and samples from its own stream (seed, 7, k), made all at start | lazy: the same, each user
    # made when it is picked (data/population.py): millions of users hold a few bytes each
    test_users: int = option(0, at_least=0)  # the global test set: the test splits of this many users drawn from
    # the seed (0: every user's); each user's own split is still its local test data

    def check(self, cfg, section: str) -> None:
        if cfg.input_scale != "standardize":
            raise ConfigError("input_scale applies to image datasets; synthetic's features are not pixels "
                              "(leave input_scale=standardize)")
        if self.max_samples_per_client and self.max_samples_per_client <= self.samples_per_client:
            raise ConfigError(f"synthetic.max_samples_per_client={self.max_samples_per_client} must be above "
                              f"synthetic.samples_per_client={self.samples_per_client} (0: every client the same)")
        if self.test_users > int(cfg.num_clients):
            raise ConfigError(f"synthetic.test_users={self.test_users} is more than the {cfg.num_clients} users "
                              "(num_clients); allowed: 0 (every user's test split) .. num_clients")
        if self.generate == "lazy":
            if cfg.partition.name != "natural":
                raise ConfigError(f"synthetic.generate=lazy makes each user's own samples when it is picked, so its "
                                  f"partition is the users': set partition.name=natural (not {cfg.partition.name!r})")
            if cfg.long_tail.imbalance > 1 or cfg.eval.validation > 0:
                what = "long_tail.imbalance" if cfg.long_tail.imbalance > 1 else "eval.validation"
                raise ConfigError(f"{what} reshapes the whole training set, which synthetic.generate=lazy never "
                                  "holds: use synthetic.generate=per_user")
            if not self.test_users and int(cfg.num_clients) > 100_000:
                raise ConfigError(f"synthetic.generate=lazy with {cfg.num_clients} users: the global test set would "
                                  "be every user's test split; set synthetic.test_users (e.g. 1000) to test on a "
                                  "sample of users")
            if not int(cfg.eval.local_clients) and int(cfg.num_clients) > 100_000:
                raise ConfigError(f"synthetic.generate=lazy with {cfg.num_clients} users: each evaluation would make "
                                  "and test every user's own split; set eval.local_clients (e.g. 100) to test a "
                                  "sample of them each evaluation")
            from raysim.registry import SELECTIONS

            if SELECTIONS.get(cfg.selection).reads_every_client and int(cfg.num_clients) > LAZY_SCAN_LIMIT:
                raise ConfigError(f"selection={cfg.selection} reads every client's label counts before round 1 and "
                                  f"scans them all at each pick: synthetic.generate=lazy would make all "
                                  f"{cfg.num_clients} users for it first (110 s for 200,000 on 2 cores, hours at "
                                  f"millions); at most {LAZY_SCAN_LIMIT:,} users with it, or another selection")
            return
        Synthetic.check_memory(cfg)


@DATASETS.register("synthetic")
class Synthetic:
    """FedProx Synthetic(alpha, beta) (Li et al. 2020): user k draws W_k, b_k ~ N(u_k, 1),
    u_k ~ N(0, alpha); x ~ N(v_k, Sigma), v_k ~ N(B_k, 1), B_k ~ N(0, beta), Sigma_jj = j^-1.2;
    y = argmax(W_k x + b_k). One user per client (`num_clients` users); natural partition."""

    Options = SyntheticOptions
    num_classes = 10

    @staticmethod
    def classes(cfg: DictConfig) -> int:
        return int(cfg.synthetic.num_classes)

    @staticmethod
    def sizes(cfg: DictConfig, rng: np.random.Generator) -> np.ndarray:
        """Samples per user: `samples_per_client` (uniform up to `max_samples_per_client` when
        that is set), or FedProx's log-normal sizes, capped at `max_samples_per_client` when
        that is set (the first draw of the dataset's generator, so the memory check sees the
        sizes `load` makes)."""
        s = cfg.synthetic
        if s.samples_per_client > 0 and s.max_samples_per_client:
            return rng.integers(int(s.samples_per_client), int(s.max_samples_per_client) + 1, int(cfg.num_clients))
        if s.samples_per_client > 0:
            return np.full(int(cfg.num_clients), int(s.samples_per_client))
        sizes = rng.lognormal(4, 2, int(cfg.num_clients)).astype(int) + 50
        return np.minimum(sizes, int(s.max_samples_per_client) or 20000)  # 20,000: keep the heavy tail from exhausting memory

    @staticmethod
    def check_memory(cfg: DictConfig) -> None:
        """Refuse, with the numbers, a dataset this machine cannot hold: generating it keeps
        about three copies of the features (generated, split, shared through the object
        store) and each user's model."""
        import psutil

        s = cfg.synthetic
        n_samples = int(Synthetic.sizes(cfg, np.random.default_rng([cfg.seed, 7])).sum())
        d, c, n = int(s.dim), int(s.num_classes), int(cfg.num_clients)
        need = n_samples * (3 * 4 * d + 4 * 8) + n * (12 * d * c + 8 * d)
        have = psutil.virtual_memory().available
        if need > 0.8 * have:
            how = f"{s.samples_per_client} samples each" if s.samples_per_client > 0 else "FedProx's log-normal sizes"
            raise ConfigError(f"dataset 'synthetic': {n} clients with {how} make {n_samples:,} samples x {d} "
                              f"features, about {need / 2**30:.1f} GB to generate and share; this machine has "
                              f"{have / 2**30:.1f} GB available: use fewer clients or a smaller "
                              "synthetic.samples_per_client")

    @staticmethod
    def user(cfg: DictConfig, k: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """`synthetic.generate=per_user`: user k's `size` samples and labels, from its own
        stream (seed, 7, k) alone: the same whether made with every other user or by itself
        (a client's data made when it is picked, issue 73)."""
        s = cfg.synthetic
        d, c = int(s.dim), int(s.num_classes)
        rng = np.random.default_rng([int(cfg.seed), 7, int(k)])
        u, b_mean = rng.normal(0, s.alpha), rng.normal(0, s.beta)
        w = rng.normal(u, 1, (d, c)).astype(np.float32)
        b = rng.normal(u, 1, c)
        v = rng.normal(b_mean, 1, d).astype(np.float32)
        x = rng.standard_normal((int(size), d), dtype=np.float32)
        x *= np.sqrt(np.arange(1, d + 1, dtype=np.float64) ** -1.2).astype(np.float32)
        x += v
        return x, np.argmax(x @ w + b, axis=1).astype(np.int64)

    @staticmethod
    def test_users(cfg: DictConfig) -> Optional[np.ndarray]:
        """The users whose test splits make the global test set (sorted), or None for all."""
        k = int(cfg.synthetic.test_users)
        if not k:
            return None
        return np.sort(np.random.default_rng([int(cfg.seed), 8]).choice(int(cfg.num_clients), k, replace=False))

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        s = cfg.synthetic
        n_users, d, c = int(cfg.num_clients), int(s.dim), int(s.num_classes)
        rng = np.random.default_rng([cfg.seed, 7])
        sizes = Synthetic.sizes(cfg, rng)
        if s.generate == "lazy":
            from omegaconf import OmegaConf

            from raysim.data.population import LazyRows, Population

            plain = {"seed": int(cfg.seed), "synthetic": OmegaConf.to_container(s)}
            pop = Population("synthetic", plain, sizes, (sizes * float(s.test_fraction)).astype(np.int64), c, (d,))
            users = Synthetic.test_users(cfg)
            x_test, y_test, owners = pop.tests(np.arange(n_users) if users is None else users)
            return FederatedData("synthetic", LazyRows(pop, "x"), LazyRows(pop, "y"), x_test, y_test, c,
                                 users_test=owners, population=pop)
        if s.generate == "per_user":
            made = [Synthetic.user(cfg, k, sizes[k]) for k in range(n_users)]
            x = np.concatenate([m[0] for m in made]) if made else np.zeros((0, d), np.float32)
            y = np.concatenate([m[1] for m in made]) if made else np.zeros(0, np.int64)
            return Synthetic._split(x, y, sizes, float(s.test_fraction), c, Synthetic.test_users(cfg))
        sigma = np.arange(1, d + 1, dtype=np.float64) ** -1.2
        u = rng.normal(0, s.alpha, n_users)
        b_mean = rng.normal(0, s.beta, n_users)
        w = rng.normal(u[:, None, None], 1, (n_users, d, c))
        b = rng.normal(u[:, None], 1, (n_users, c))
        v = rng.normal(b_mean[:, None], 1, (n_users, d))
        owner = np.repeat(np.arange(n_users), sizes)
        x = rng.standard_normal((len(owner), d), dtype=np.float32)
        x *= np.sqrt(sigma).astype(np.float32)
        x += v.astype(np.float32)[owner]
        y = np.empty(len(owner), np.int64)
        ends = np.cumsum(sizes)
        w32 = w.astype(np.float32)
        for k in range(n_users):  # labels from each user's own model
            lo = ends[k] - sizes[k]
            y[lo:ends[k]] = np.argmax(x[lo:ends[k]] @ w32[k] + b[k], axis=1)
        return Synthetic._split(x, y, sizes, float(s.test_fraction), c, Synthetic.test_users(cfg))

    @staticmethod
    def _split(x: np.ndarray, y: np.ndarray, sizes: np.ndarray, test_fraction: float, c: int,
               test_users: Optional[np.ndarray] = None) -> FederatedData:
        """Users' samples in user order: each user's last `test_fraction` go to the test set
        (of which `test_users`' make the global one, when given)."""
        owner = np.repeat(np.arange(len(sizes)), sizes)
        ends = np.cumsum(sizes)
        n_test = (sizes * test_fraction).astype(int)
        is_test = (np.arange(len(owner)) - (ends - sizes)[owner]) >= (sizes - n_test)[owner]
        users_test = owner[is_test]
        chosen = None if test_users is None else np.flatnonzero(np.isin(users_test, test_users))
        return FederatedData("synthetic", x[~is_test], y[~is_test], x[is_test], y[is_test], c,
                             users_train=owner[~is_test], users_test=users_test, global_test=chosen)


def num_classes(cfg: DictConfig) -> int:
    """Classes of the configured dataset, known without loading it."""
    ds = DATASETS.get(cfg.dataset)
    return ds.classes(cfg) if hasattr(ds, "classes") else ds.num_classes


def load_dataset(cfg: DictConfig) -> FederatedData:
    return DATASETS.get(cfg.dataset).load(cfg)
