"""dataset=hf (raysim/data/hf.py): Hugging Face datasets from local files the test writes in
their own format (parquet with an Image feature; csv text), partitioned by our partitioners
and trained; the missing extra and an offline hub id are one line."""
import json

import numpy as np
import pytest

from raysim.config import ConfigError, load_config
from raysim.run import main

datasets = pytest.importorskip("datasets")


def write_images(folder, n_train=240, n_test=60, writers=6):
    """Two splits of 8x8 greyscale PNGs (a bright row at the class's height, plus noise), a
    ClassLabel of 4 classes and a writer id per image, as parquet files `datasets` reads back."""
    from PIL import Image

    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c", "d"]),
                                  "writer": datasets.Value("string")})
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, 4, n)
        images = []
        for c in labels:
            a = rng.integers(0, 60, (8, 8)).astype(np.uint8)
            a[2 * c: 2 * c + 2] = 250
            images.append(Image.fromarray(a, mode="L"))
        writer = [f"w{int(i) % writers}" for i in range(n)]
        ds = datasets.Dataset.from_dict({"image": images, "label": labels.tolist(), "writer": writer}, features=features)
        ds.to_parquet(str(folder / f"{split}.parquet"))
    return folder


def test_images_from_parquet_load_partition_and_train(ray_local, tmp_path):
    """The folder's parquet files as dataset=hf: uint8 (1, 8, 8) images with the ClassLabel's
    4 classes; Dirichlet and natural (a client per writer, with its own test images) each
    train 2 rounds and learn the easy task; --show-partition prints its table."""
    from raysim.data.datasets import load_dataset

    folder = write_images(tmp_path / "imgs")
    cfg = load_config(overrides=["dataset=hf", f"hf.path={folder}", f"data_dir={tmp_path}"])
    data = load_dataset(cfg)
    assert data.x_train.dtype == np.uint8 and data.x_train.shape == (240, 1, 8, 8) and data.num_classes == 4
    assert data.x_test.shape == (60, 1, 8, 8) and set(np.unique(data.y_train)) == {0, 1, 2, 3}
    common = ["dataset=hf", f"hf.path={folder}", "model=mclr", "rounds=2", "local.epochs=3", "local.lr=0.1",
              f"output_dir={tmp_path / 'runs'}", "--quiet"]
    assert main([*common, "num_clients=6", "partition.beta=0.5", "run_name=dir"]) == 0
    assert main([*common, "num_clients=4", "participation=1.0", "partition=natural", "hf.partition_column=writer",
                 "run_name=nat"]) == 0
    for name in ("dir", "nat"):
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["final_accuracy"] > 0.5, (name, summary)
    import pyarrow.parquet as pq

    clients = pq.read_table(tmp_path / "runs" / "nat" / "clients.parquet").to_pylist()
    assert {c["cid"] for c in clients if c["method"] == "client_update"} <= {0, 1, 2, 3}
    assert sum(c["num_samples"] for c in clients if c["method"] == "client_update" and c["round"] == 1) == 160  # 4 of 6 writers


def test_text_from_csv_trains_an_lstm_on_a_vocabulary(ray_local, tmp_path):
    """A csv of sentences with string labels: a vocabulary from the training split, token ids
    (N, max_words), labels 0..K-1 in sorted order; no test split: hf.test_fraction of train."""
    from raysim.data.datasets import load_dataset

    rng = np.random.default_rng(1)
    rows = ["text,label"]
    for _ in range(200):
        good = rng.random() < 0.5
        words = rng.choice(["great", "lovely", "fine"] if good else ["awful", "bad", "poor"], 3).tolist()
        rows.append(f"{' '.join(words + ['the', 'film'])},{'pos' if good else 'neg'}")
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "train.csv").write_text("\n".join(rows) + "\n")
    common = ["dataset=hf", f"hf.path={tmp_path / 'txt'}", "hf.text_column=text", "hf.max_words=6", "hf.vocab_size=50"]
    data = load_dataset(load_config(overrides=[*common, f"data_dir={tmp_path}"]))
    assert data.x_train.shape == (160, 6) and data.x_test.shape == (40, 6) and data.num_classes == 2
    assert data.x_train.dtype == np.int64 and data.x_train.max() < 52
    assert main([*common, "model=lstm", "model_options.vocab_size=52", "model_options.embed_dim=8",
                 "num_clients=4", "rounds=2", "local.lr=0.5", f"data_dir={tmp_path}",
                 f"output_dir={tmp_path / 'runs'}", "run_name=t", "--quiet"]) == 0
    assert json.loads((tmp_path / "runs" / "t" / "summary.json").read_text())["rounds"] == 2


def test_text_through_a_named_tokenizer(tmp_path):
    """hf.tokenizer: a Hugging Face tokenizer by name or folder (here a word-level one the
    test saves), its ids cut and padded to hf.max_words; an LSTM table too small is refused."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from raysim.data.datasets import load_dataset

    vocab = {"[PAD]": 0, "[UNK]": 1, "great": 2, "awful": 3, "the": 4, "film": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(tmp_path / "tok")
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "train.csv").write_text("text,label\ngreat the film,1\nawful film,0\nthe great film,1\n"
                                                "awful awful,0\ngreat,1\n")
    common = ["dataset=hf", f"hf.path={tmp_path / 'txt'}", "hf.text_column=text", f"hf.tokenizer={tmp_path / 'tok'}",
              "hf.max_words=3", "hf.test_fraction=0.4", f"data_dir={tmp_path}"]
    data = load_dataset(load_config(overrides=common))
    rows = {tuple(r) for r in np.concatenate([data.x_train, data.x_test]).tolist()}
    assert rows == {(2, 4, 5), (3, 5, 0), (4, 2, 5), (3, 3, 0), (2, 0, 0)}
    with pytest.raises(ConfigError, match="has 6 tokens: model_options.vocab_size=4"):
        load_dataset(load_config(overrides=[*common, "model=lstm", "model_options.vocab_size=4"]))


def test_a_hub_id_offline_and_a_missing_extra_are_one_line(tmp_path, monkeypatch):
    from raysim.data.datasets import load_dataset

    cfg = load_config(overrides=["dataset=hf", "hf.path=nobody/no-such-dataset", "download=false",
                                 f"data_dir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        load_dataset(cfg)
    text = str(e.value)
    assert "'nobody/no-such-dataset' is not a local folder" in text and str(tmp_path / "hf") in text
    assert "download=false" in text and "\n" not in text
    with pytest.raises(ConfigError) as e:  # download=true: the hub is asked only if it answers at once
        load_dataset(load_config(overrides=["dataset=hf", "hf.path=nobody/no-such-dataset", f"data_dir={tmp_path}"]))
    assert "'nobody/no-such-dataset' is not a local folder" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="hf.path=.*: no such file or folder"):
        load_dataset(load_config(overrides=["dataset=hf", f"hf.path={tmp_path / 'nope'}"]))
    with pytest.raises(ConfigError, match="dataset=hf needs hf.path"):
        load_config(overrides=["dataset=hf"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'raysim\[hf\]'"):
        load_config(overrides=["dataset=hf", "hf.path=x/y"])


def test_a_column_of_numbers_is_read_from_the_arrow_cache_in_place(ray_local, tmp_path):
    """hf.feature_column (Array3D float32): with data_store=files the training inputs stay in
    the Arrow files `datasets` keeps (here 3 shards; one segment per record batch, read by the
    client actors; raysim writes only the labels), and the model is the memory path's, bit
    for bit."""
    import torch

    from raysim.data.datasets import load_dataset

    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 3, 4, 4)).astype(np.float32)
    labels = (x[:, 0, 0, 0] > 0).astype(np.int64) + 2 * (x[:, 1, 0, 0] > 0)
    features = datasets.Features({"x": datasets.Array3D(shape=(3, 4, 4), dtype="float32"),
                                  "label": datasets.ClassLabel(num_classes=4)})

    def rows(a, b):
        for i in range(a, b):
            yield {"x": x[i].tolist(), "label": int(labels[i])}

    folder = tmp_path / "numbers"
    train = datasets.Dataset.from_generator(rows, gen_kwargs={"a": 0, "b": 160}, features=features,
                                            cache_dir=str(tmp_path / "gen"), writer_batch_size=16)
    test = datasets.Dataset.from_generator(rows, gen_kwargs={"a": 160, "b": 200}, features=features,
                                           cache_dir=str(tmp_path / "gen"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder), num_shards={"train": 3, "test": 1})

    common = ["dataset=hf", f"hf.path={folder}", "hf.feature_column=x", "model=mclr", "num_clients=5",
              "rounds=2", "local.lr=0.1", f"data_store_dir={tmp_path / 'arrays'}", f"output_dir={tmp_path / 'runs'}"]
    cfg = load_config(overrides=[*common, "data_store=files"])
    data = load_dataset(cfg)
    entry = data.stored["arrays"]["x_train"]
    assert {p for p, _, _ in entry["segments"]} <= {str(p) for p in folder.rglob("*.arrow")}
    assert len(entry["segments"]) >= 3 and sum(n for _, _, n in entry["segments"]) == 160  # a record batch each
    assert np.array_equal(np.asarray(data.x_train), x[:160]) and np.array_equal(data.x_test, x[160:])
    assert main([*common, "data_store=files", "run_name=files", "--quiet"]) == 0
    assert main([*common, "data_store=memory", "run_name=memory", "--quiet"]) == 0
    a, b = (torch.load(tmp_path / "runs" / n / "model.pt", weights_only=True)["global"] for n in ("files", "memory"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    written = sorted(p.name for p in (tmp_path / "arrays").rglob("*.npy"))
    assert written == ["y_train.npy"], written  # the inputs were not copied
