"""LEAF's federated datasets (Caldas et al. 2018) from their JSON files: FEMNIST (a client
per writer) and Sent140 (a client per Twitter user), each user with its own train and test
samples, so `partition=natural` and the clients' own test data come from the files.

Files: LEAF's `preprocess.sh` output, `<data_dir>/<name>/train/*.json` and
`<data_dir>/<name>/test/*.json` (or LEAF's own layout, `<data_dir>/<name>/data/train`):
    {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}
Clients are the users of the train files in sorted order; `num_clients` takes the first
that many (the FedGroup paper: 200 FEMNIST writers, 772 Sent140 users). Test samples of
users outside them are left out. Nothing is downloaded: LEAF builds these files from
NIST / Sentiment140 with its own scripts.

- FEMNIST: x = 784 floats in [0, 1] (LEAF's inverted 28x28 scans), y = 0..61; kept as
  uint8 and standardised like MNIST.
- Sent140: x = LEAF's raw tweet record (its text is the last field), y = 0 / 1. Words are
  LEAF's tokens (`[\\w']+` and punctuation, lower-cased), the first `max_words` of a tweet,
  padded. Without `sent140.embeddings`: token ids over the `vocab_size` most frequent
  training words (0 padding, 1 unknown), for the `lstm` model's trained embedding table.
  With `sent140.embeddings` (a GloVe-style text file: a word, then its vector, per line):
  each token becomes its vector (unknown words and padding: zeros), frozen, as LEAF's
  model keeps GloVe fixed.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from omegaconf import DictConfig

from raysim.errors import ConfigError
from raysim.data.datasets import FederatedData, _pixels, _scaling
from raysim.options import Options, option
from raysim.registry import DATASETS


def _folder(cfg: DictConfig, name: str, split: str) -> Path:
    root = Path(cfg.data_dir).expanduser() / name
    for cand in (root / split, root / "data" / split):
        if cand.is_dir() and any(cand.glob("*.json")):
            return cand
    raise ConfigError(f"dataset {name!r}: no LEAF JSON files in {root / split} (or {root / 'data' / split}); "
                      f"build them with LEAF's preprocess.sh and put the train/ and test/ folders under "
                      f"{root}, or set data_dir=<folder that has {name}/>")


def read_leaf(folder: Path) -> dict[str, dict]:
    """{user: {"x": [...], "y": [...]}} from every JSON file of `folder` (files in name order)."""
    users: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
            for u in doc["users"]:
                d = doc["user_data"][u]
                got = users.setdefault(u, {"x": [], "y": []})
                got["x"].extend(d["x"])
                got["y"].extend(d["y"])
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not a LEAF JSON file ({type(e).__name__}: {e}); expected "
                              '{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}}') from None
    return users


def _users_and_samples(cfg: DictConfig, name: str) -> tuple[list[str], dict, dict]:
    train, test = read_leaf(_folder(cfg, name, "train")), read_leaf(_folder(cfg, name, "test"))
    users = sorted(train)
    n = int(cfg.num_clients)
    if n > len(users):
        raise ConfigError(f"dataset {name!r}: num_clients={n} but the files hold {len(users)} users; "
                          f"use num_clients <= {len(users)}")
    return users[:n], train, test


def _stack(users: list[str], split: dict, convert) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs, ys, owner = [], [], []
    for i, u in enumerate(users):
        d = split.get(u)
        if not d or not d["y"]:
            continue
        xs.append(convert(d["x"]))
        y = np.asarray(d["y"])
        if not np.issubdtype(y.dtype, np.integer) and not (np.issubdtype(y.dtype, np.floating)
                                                           and np.all(np.mod(y, 1) == 0)):
            bad = next(v for v in d["y"] if not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()))
            raise ConfigError(f"the LEAF files give user {u!r} the label {bad!r}; labels are class ids (integers)")
        ys.append(y.astype(np.int64))
        owner.append(np.full(len(d["y"]), i, dtype=np.int64))
    if not xs:
        raise ConfigError("the LEAF files hold no samples for the chosen users")
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(owner)


@DATASETS.register("femnist")
class FEMNIST:
    """Handwritten digits and letters (62 classes), a client per writer (module docstring)."""

    num_classes = 62

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        users, train, test = _users_and_samples(cfg, "femnist")

        def pixels(x):
            a = np.asarray(x, dtype=np.float32)
            if a.ndim != 2 or a.shape[1] != 784:
                raise ConfigError(f"dataset 'femnist': a sample has {a.shape[-1]} values, expected 784 (28x28)")
            return np.rint(a.reshape(-1, 28, 28) * 255).clip(0, 255).astype(np.uint8)

        mean, std = _scaling(cfg, (0.1307,), (0.3081,))
        parts = [_stack(users, s, pixels) for s in (train, test)]
        (xtr, ytr, otr), (xte, yte, ote) = parts
        return FederatedData("femnist", _pixels(xtr), ytr, _pixels(xte), yte, 62,
                             users_train=otr, users_test=ote, norm=(mean, std), pixel_max=255.0,
                             label_source=tuple(f"the LEAF files in {_folder(cfg, 'femnist', s)}" for s in ("train", "test")))


@dataclass
class Sent140Options(Options):
    max_words: int = option(25, at_least=1)  # words per tweet (LEAF: 25)
    vocab_size: int = option(10000, at_least=1)  # most frequent training words kept (without embeddings)
    embeddings: Optional[str] = None  # GloVe-style text file: frozen word vectors instead of token ids

    def check(self, cfg, section: str) -> None:
        if self.embeddings is not None and not Path(self.embeddings).expanduser().is_file():
            raise ConfigError(f"sent140.embeddings: no file {self.embeddings}")
        vocab = cfg.model_options.get("vocab_size", 10002)
        if cfg.model == "lstm" and self.embeddings is None and vocab < self.vocab_size + 2:
            raise ConfigError(f"model_options.vocab_size={vocab} must be >= sent140.vocab_size + 2 = "
                              f"{self.vocab_size + 2} (the words, padding and unknown)")


TOKEN = re.compile(r"[\w']+|[.,!?;]")


def tokens(text: str) -> list[str]:
    return TOKEN.findall(str(text).lower())


def read_vectors(path: Path, words: set) -> tuple[dict[str, np.ndarray], int]:
    """The vectors of `words` from a GloVe-style file (word v1 v2 ... per line)."""
    found: dict[str, np.ndarray] = {}
    dim = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip().split(" ")
                if len(parts) < 2:
                    continue
                dim = dim or len(parts) - 1
                if parts[0] in words and len(parts) - 1 == dim:
                    found[parts[0]] = np.asarray(parts[1:], dtype=np.float32)
    except OSError as e:
        raise ConfigError(f"sent140.embeddings: cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise ConfigError(f"sent140.embeddings: {path} is not a word-vector text file (a word, then numbers)") from None
    if not dim:
        raise ConfigError(f"sent140.embeddings: {path} holds no word vectors")
    return found, dim


@DATASETS.register("sent140")
class Sent140:
    """Sentiment140 tweets, a client per user, labels 0 / 1 (module docstring)."""

    Options = Sent140Options
    num_classes = 2

    @staticmethod
    def load(cfg: DictConfig) -> FederatedData:
        s = cfg.sent140
        users, train, test = _users_and_samples(cfg, "sent140")
        text = lambda record: record[-1] if isinstance(record, (list, tuple)) else record  # noqa: E731
        counts = Counter(w for u in users for r in train.get(u, {"x": []})["x"] for w in tokens(text(r)))
        L = int(s.max_words)
        if s.embeddings is None:
            vocab = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(int(s.vocab_size)))}

            def convert(records):
                out = np.zeros((len(records), L), dtype=np.int64)
                for j, r in enumerate(records):
                    ids = [vocab.get(w, 1) for w in tokens(text(r))[:L]]
                    out[j, :len(ids)] = ids
                return out
        else:
            vectors, dim = read_vectors(Path(s.embeddings).expanduser(), set(counts))

            def convert(records):
                out = np.zeros((len(records), L, dim), dtype=np.float32)
                for j, r in enumerate(records):
                    for k, w in enumerate(tokens(text(r))[:L]):
                        if w in vectors:
                            out[j, k] = vectors[w]
                return out
        (xtr, ytr, otr), (xte, yte, ote) = (_stack(users, split, convert) for split in (train, test))
        return FederatedData("sent140", xtr, ytr, xte, yte, 2, users_train=otr, users_test=ote,
                             label_source=tuple(f"the LEAF files in {_folder(cfg, 'sent140', s)}" for s in ("train", "test")))
