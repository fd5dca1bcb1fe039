"""LEAF's FEMNIST and Sent140 from small JSON files in LEAF's own format, written here."""
import json

import numpy as np
import pytest
import torch

from raysim.config import ConfigError, load_config
from raysim.experiment import prepare
from raysim.models import build_model
from raysim.runtime.local_eval import clients_test_data


def write_leaf(root, name, users_train, users_test, files=2):
    """users_*: {user: (xs, ys)}; the train users are spread over `files` JSON files."""
    for split, users in (("train", users_train), ("test", users_test)):
        folder = root / name / split
        folder.mkdir(parents=True)
        names = sorted(users)
        for f in range(files):
            mine = names[f::files]
            doc = {"users": mine, "num_samples": [len(users[u][1]) for u in mine],
                   "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in mine}}
            (folder / f"part_{f}.json").write_text(json.dumps(doc))


def femnist_users(rng, n_users, per_user, label_of):
    out = {}
    for i in range(n_users):
        ys = [label_of(i, j) for j in range(per_user)]
        xs = [rng.random(784).round(3).tolist() for _ in ys]
        out[f"f{i:04d}_{i}"] = (xs, ys)
    return out


def test_femnist_json_gives_one_client_per_writer_with_its_own_test_data(tmp_path):
    rng = np.random.default_rng(0)
    train = femnist_users(rng, 5, 6, lambda i, j: (7 * i + j) % 62)
    test = femnist_users(rng, 5, 2, lambda i, j: 61 - i)
    write_leaf(tmp_path, "femnist", train, test)
    cfg = load_config(overrides=["dataset=femnist", f"data_dir={tmp_path}", "num_clients=4", "model=mlp"])
    assert cfg.partition.name == "natural" and cfg.model == "mlp"  # the dataset's config group, then the user
    data, part, classes = prepare(cfg)
    assert classes == 62 and data.input_shape == (1, 28, 28) and len(part.train) == 4
    first = sorted(train)[0]  # clients are the writers in sorted order; the fifth is left out
    assert data.y_train[part.train[0]].tolist() == train[first][1]
    pixel = np.rint(np.asarray(train[first][0][0]) * 255) / 255  # uint8 then MNIST's standardisation
    assert np.allclose(data.inputs(data.x_train[part.train[0][0]][None]).reshape(-1), (pixel - 0.1307) / 0.3081, atol=1e-5)
    tests = clients_test_data(data, part, cfg)  # each writer's own test samples
    assert tests.sizes.tolist() == [2, 2, 2, 2] and len(data.y_test) == 8
    assert data.y_test[data.users_test == 3].tolist() == [58, 58]


def test_sent140_json_builds_a_vocabulary_or_reads_word_vectors(tmp_path):
    train = {"u1": ([["1", "date", "NO_QUERY", "u1", "Good day, good FOOD!"]] * 2 + [["2", "d", "q", "u1", "bad"]], [1, 1, 0]),
             "u2": ([["3", "d", "q", "u2", "so bad bad day"]], [0])}
    test = {"u1": ([["4", "d", "q", "u1", "good unseenword"]], [1]), "u2": ([["5", "d", "q", "u2", "bad"]], [0])}
    write_leaf(tmp_path, "sent140", train, test, files=1)
    cfg = load_config(overrides=["dataset=sent140", f"data_dir={tmp_path}", "num_clients=2", "sent140.max_words=6"])
    data, part, classes = prepare(cfg)
    assert classes == 2 and data.x_train.shape == (4, 6) and data.x_train.dtype == np.int64
    # vocabulary by training frequency: bad 4, good 4 ... (ids from 2; 0 padding, 1 unknown)
    first = data.x_train[0].tolist()  # "good day , good food !"
    assert first[0] == first[3] and first[0] >= 2 and 0 not in first
    assert data.x_test[0].tolist()[1] == 1 and data.x_test[0].tolist()[2:] == [0, 0, 0, 0]  # unknown, padding
    model = build_model("lstm", data.input_shape, 2)
    assert model(torch.from_numpy(data.x_train)).shape == (4, 2)
    vec = tmp_path / "vectors.txt"
    vec.write_text("good 1 0 0\nbad 0 1 0\nday 0 0 1\nunused 5 5 5\n")
    cfg = load_config(overrides=["dataset=sent140", f"data_dir={tmp_path}", "num_clients=2", "sent140.max_words=4",
                                 f"sent140.embeddings={vec}"])
    data, part, _ = prepare(cfg)
    assert data.input_shape == (4, 3) and data.x_train[3, :2].tolist() == [[0, 0, 0], [0, 1, 0]]  # "so" unknown: 0s
    assert build_model("lstm", data.input_shape, 2)(torch.from_numpy(data.x_train)).shape == (4, 2)


def test_missing_or_malformed_leaf_files_are_one_clear_message(tmp_path):
    cfg = load_config(overrides=["dataset=femnist", f"data_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="no LEAF JSON files in .*femnist/train"):
        prepare(cfg)
    (tmp_path / "femnist" / "train").mkdir(parents=True)
    (tmp_path / "femnist" / "train" / "bad.json").write_text("{not json")
    (tmp_path / "femnist" / "test").mkdir(parents=True)
    (tmp_path / "femnist" / "test" / "t.json").write_text('{"users": [], "user_data": {}}')
    with pytest.raises(ConfigError, match="bad.json: not a LEAF JSON file"):
        prepare(cfg)


def test_fedgroup_runs_on_femnist_files_and_evaluates_each_writer_on_its_own_test_data(ray_local, tmp_path):
    import pyarrow.parquet as pq

    from raysim.run import main

    rng = np.random.default_rng(1)
    write_leaf(tmp_path, "femnist", femnist_users(rng, 8, 12, lambda i, j: (i % 2) * 10 + j % 3),
               femnist_users(rng, 8, 3, lambda i, j: (i % 2) * 10 + j % 3))
    assert main(["dataset=femnist", f"data_dir={tmp_path}", "num_clients=8", "algorithm=fedgroup", "fedgroup.groups=2",
                 "fedgroup.alpha=3", "participation=0.5", "rounds=2", "local.epochs=1", f"output_dir={tmp_path}",
                 "run_name=f", "--quiet"]) == 0
    rows = pq.read_table(tmp_path / "f" / "clients.parquet").to_pylist()
    evaluated = [r for r in rows if r["method"] == "evaluate" and r["round"] == 2]
    assert sorted(r["cid"] for r in evaluated) == list(range(8)) and all(r["num_samples"] == 3 for r in evaluated)
