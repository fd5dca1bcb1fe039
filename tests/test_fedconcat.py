"""FedConcat / FedConcat-ID: clustering, label inference, the concatenated model, features
cached once per client, and byte counts that match the parameter sizes."""
import pytest
import numpy as np
import pyarrow.parquet as pq
import torch

from raysim.algorithms.fedconcat import ConcatModel, balance, cluster, inferred_distribution
from raysim.models import build_model
from raysim.run import main
from raysim.training import local_sgd


def test_clients_with_the_same_label_distribution_share_a_cluster():
    rng = np.random.default_rng(0)
    kinds = np.array([[0.5, 0.5, 0, 0, 0, 0], [0, 0, 0.5, 0.5, 0, 0], [0, 0, 0, 0, 0.9, 0.1]])
    which = rng.permutation(np.repeat([0, 1, 2], [5, 4, 3]))
    labels = cluster(kinds[which], 3, seed=0)
    for i in range(len(which)):
        for j in range(len(which)):
            assert (labels[i] == labels[j]) == (which[i] == which[j])


def test_rebalance_caps_cluster_sizes_and_moves_the_farthest_members():
    vectors = np.array([[0.0], [0.1], [0.2], [0.3], [0.9], [5.0]])
    centres = np.array([[0.3], [5.0]])
    labels = balance(vectors, np.array([0, 0, 0, 0, 0, 1]), centres)
    assert np.bincount(labels).max() <= 3  # ceil(6 / 2)
    assert labels[4] == 1 and labels[0] == 1  # the two farthest from centre 0 (0.9, then 0.0) moved
    assert list(labels[1:4]) == [0, 0, 0]


def test_inferred_distribution_of_a_two_class_model_puts_its_mass_on_them():
    from sklearn.datasets import load_digits

    d = load_digits()
    keep = np.isin(d.target, [3, 7])
    x = torch.from_numpy(((d.images[keep] / 16.0 - 0.5) / 0.5).astype(np.float32))[:, None]
    y = torch.from_numpy(d.target[keep].astype(np.int64))
    from raysim.contract import Client
    from raysim.config import load_config

    cfg = load_config(overrides=["local.epochs=5", "local.lr=0.05"])
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    client = Client(0, 1, cfg, x, y, 10, torch.device("cpu"), torch.Generator().manual_seed(0), {}, model, epochs=5)
    local_sgd(client, model)
    probe = torch.rand(2000, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1  # the inputs' range
    dist = inferred_distribution(model, probe)
    assert abs(dist.sum() - 1) < 1e-6
    assert dist[3] + dist[7] > 0.8, dist
    assert min(dist[3], dist[7]) > max(np.delete(dist, [3, 7]))


def test_concatenated_model_is_the_classifier_on_concatenated_features():
    torch.manual_seed(0)
    parts = [build_model("mlp", (1, 8, 8), 10) for _ in range(3)]
    concat = ConcatModel([p.encoder for p in parts], parts[0].feature_dim, 10)
    x = torch.randn(7, 1, 8, 8)
    feats = torch.cat([p.encoder(x) for p in parts], dim=1)
    assert feats.shape == (7, 3 * 200)
    assert torch.allclose(concat(x), concat.head(feats))
    # initialised from the cluster classifiers, it is the mean of the cluster models' logits
    from raysim.algorithms.fedconcat import FedConcat

    algo = FedConcat.__new__(FedConcat)
    algo.models = parts
    algo._init_from_clusters(concat)
    assert torch.allclose(concat(x), torch.stack([p(x) for p in parts]).mean(0), atol=1e-5)


def model_bytes(module) -> int:
    return sum(v.numel() * v.element_size() for v in module.state_dict().values())


def test_features_once_per_client_bytes_match_parameter_sizes_and_actor_count_does_not_matter(ray_local, tmp_path):
    common = ["algorithm=fedconcat", "dataset=digits", "model=mlp", "partition=classes", "partition.k=2",
              "num_clients=12", "participation=0.5", "rounds=6", "fedconcat.encoder_rounds=3",
              "fedconcat.clusters=3", "local.epochs=1", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "run_name=a", "resources.clients_per_actor=12"]) == 0
    assert main([*common, "run_name=b", "resources.clients_per_actor=4"]) == 0
    d = tmp_path / "a"
    rows = pq.read_table(d / "clients.parquet").to_pylist()
    cached = [r["cid"] for r in rows if r["method"] == "cache_features"]
    assert sorted(cached) == list(range(12))  # every client computed its features exactly once
    assert all(r["round"] == 4 for r in rows if r["method"] == "cache_features")
    m = pq.read_table(d / "metrics.parquet").to_pylist()
    assert [r["features_cached"] for r in m[3:]] == [12, 12, 12]

    full = build_model("mlp", (1, 8, 8), 10)
    enc, head = model_bytes(full.encoder), (3 * 200 * 10 + 10) * 4
    down = [m[0]["bytes_down"]] + [b["bytes_down"] - a["bytes_down"] for a, b in zip(m, m[1:])]
    up = [m[0]["bytes_up"]] + [b["bytes_up"] - a["bytes_up"] for a, b in zip(m, m[1:])]
    labels_up = 12 * 10 * 8  # stage 1: every client's label distribution, 10 float64
    assert down[0] == 6 * model_bytes(full) and up[0] == labels_up + 6 * model_bytes(full)
    assert down[1] == down[2] == 6 * model_bytes(full)  # each cluster model to its members only
    assert down[3] == 12 * 3 * enc + 6 * head  # the encoders once to everyone, then the classifier
    assert up[3] == 6 * head  # features stay on the clients
    assert down[4] == down[5] == up[4] == up[5] == 6 * head

    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("a", "b"))
    assert torch.equal(a["classifier"]["weight"], b["classifier"]["weight"])
    assert torch.equal(a["cluster_of"], b["cluster_of"])
    # label inference instead of label counts: a full local round per client in stage 1
    assert main([*common, "algorithm=fedconcat_id", "run_name=id"]) == 0  # reads the same fedconcat.* section
    m_id = pq.read_table(tmp_path / "id" / "metrics.parquet").to_pylist()
    assert m_id[0]["bytes_up"] == 12 * model_bytes(full) + 6 * model_bytes(full)


@pytest.mark.slow
def test_fedconcat_resumes_in_the_classifier_stage_to_the_same_model(ray_local, tmp_path):
    common = ["algorithm=fedconcat", "dataset=digits", "model=mlp", "partition=classes", "partition.k=2",
              "num_clients=10", "participation=0.5", "fedconcat.encoder_rounds=2", "fedconcat.clusters=2",
              "local.epochs=1", "checkpoint_every=3", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=3", "run_name=part"]) == 0  # checkpoint after the first classifier round
    assert main([f"resume={tmp_path / 'part'}", "rounds=5", "--quiet"]) == 0
    assert main([*common, "rounds=5", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert torch.equal(a["classifier"]["weight"], b["classifier"]["weight"])
    rows = pq.read_table(tmp_path / "part" / "clients.parquet").to_pylist()
    assert sum(r["method"] == "cache_features" for r in rows) == 10  # the features came back with the checkpoint
    ma, mb = (pq.read_table(tmp_path / n / "metrics.parquet").to_pylist() for n in ("part", "whole"))
    assert [r["round_bytes_down"] for r in ma] == [r["round_bytes_down"] for r in mb]


def test_constrained_rebalance_caps_clusters_at_1_2_n_over_k():
    """The official code's balanced clustering: K-means, then size-capped K-means with
    clusters of at most int(1.2 N / K) members."""
    rng = np.random.default_rng(0)
    vectors = np.concatenate([rng.normal(0, 0.01, (14, 2)), rng.normal(5, 0.01, (3, 2)), rng.normal(-5, 0.01, (3, 2))])
    plain = cluster(vectors, 4, seed=0)
    assert np.bincount(plain, minlength=4).max() > int(1.2 * 20 / 4)  # the big blob is one or two clusters
    labels = cluster(vectors, 4, seed=0, rebalance="constrained")
    assert np.bincount(labels, minlength=4).max() <= int(1.2 * 20 / 4)  # 6
    assert (labels == cluster(vectors, 4, seed=0, rebalance="constrained")).all()  # deterministic
    assert len(set(labels[14:17])) == 1 and len(set(labels[17:])) == 1  # the small blobs stay together


class ClassifierStageServer:
    """Stands in for the runtime in stage 3: every client returns the head it is given here."""

    num_clients = 2

    def __init__(self, heads, sizes):
        self.heads, self.sizes = heads, sizes

    def select_clients(self, rnd):
        return [0, 1]

    def run_clients(self, rnd, cids, payload, method="client_update"):
        from raysim.contract import ClientResult

        for c in cids:
            yield ClientResult(c, self.sizes[c], self.heads[c], {"loss": 0.0})


def fedconcat_after_stage_2(*overrides):
    from raysim.algorithms.fedconcat import FedConcat
    from raysim.config import load_config

    cfg = load_config(overrides=["algorithm=fedconcat", "fedconcat.clusters=2", "fedconcat.encoder_rounds=1",
                                 "rounds=3", *overrides])
    algo = FedConcat(cfg, 10, (1, 8, 8))
    torch.manual_seed(0)
    algo.models = [build_model("mlp", (1, 8, 8), 10) for _ in range(2)]
    algo.feature_dim = 200
    algo.num_clients = 2
    algo.cached = {0, 1}
    return algo


def test_classifier_stage_averages_heads_unweighted_by_default():
    algo = fedconcat_after_stage_2()
    algo.concat = algo._concatenate()
    heads = [{"weight": torch.full((10, 400), float(v)), "bias": torch.full((10,), float(v))} for v in (1.0, 4.0)]
    algo._classifier_round(2, ClassifierStageServer(heads, sizes=[10, 290]))
    assert torch.allclose(algo.concat.head.weight, torch.full((10, 400), 2.5))  # (1 + 4) / 2, not by samples
    algo = fedconcat_after_stage_2("fedconcat.classifier_weighting=samples")
    algo.concat = algo._concatenate()
    algo._classifier_round(2, ClassifierStageServer(heads, sizes=[10, 290]))
    assert torch.allclose(algo.concat.head.weight, torch.full((10, 400), (10 + 4 * 290) / 300))


def test_init_classifier_sum_is_the_sum_of_the_cluster_logits():
    x = torch.randn(6, 1, 8, 8)
    for how, scale in (("sum", 1.0), ("mean", 0.5)):
        algo = fedconcat_after_stage_2(f"fedconcat.init_classifier={how}")
        concat = algo._concatenate()
        expected = scale * sum(m(x) for m in algo.models)
        assert torch.allclose(concat(x), expected, atol=1e-5), how


def test_fedconcat_says_when_its_encoders_get_under_half_the_rounds():
    from raysim.config import load_config
    from raysim.registry import ALGORITHMS

    notes = lambda *o: ALGORITHMS.get("fedconcat").config_notes(load_config(overrides=["algorithm=fedconcat", *o]))  # noqa: E731
    assert "fedconcat.encoder_rounds=20 of the 150 rounds" in " ".join(notes("rounds=150"))
    assert not notes("rounds=30") and not notes("rounds=150", "fedconcat.encoder_rounds=93")
