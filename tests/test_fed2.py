"""Fed2 (issue 14): the grouped structure against its definition (gradient isolation,
parameter count), feature paired averaging against hand-computed means, then real runs
(1 vs 3 actors, checkpoint + resume, bad settings)."""
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from raysim.contract import ClientResult
from raysim.algorithms.fed2 import Fed2
from raysim.config import load_config
from raysim.models import build_model
from raysim.models.layered import class_groups
from raysim.run import main
from raysim.testing import set_up
from raysim.training import GroupWeightedMean, cpu_state


def grouped(name, shape, classes, **opts):
    torch.manual_seed(0)
    return build_model(name, shape, classes, {"groups": 10, "grouped_layers": 6, **opts})


@pytest.mark.parametrize("name, shape, classes, opts", [
    ("vgg9", (1, 28, 28), 10, {"norm": "group"}),
    ("vgg9", (3, 32, 32), 20, {"norm": "batch", "allocation": "round_robin"}),  # 2 classes per group
    ("vgg9", (3, 32, 32), 10, {"norm": "none", "grouped_layers": 9}),  # every layer grouped
    ("vgg16", (3, 32, 32), 10, {"norm": "group"}),
    ("mobilenet", (3, 32, 32), 10, {"norm": "group"}),
    ("mobilenet", (3, 32, 32), 10, {"norm": "batch", "grouped_layers": 2}),  # the last block and the classifier
])
def test_class_c_logit_reaches_no_parameter_of_another_group(name, shape, classes, opts):
    model = grouped(name, shape, classes, **opts).train()
    rows = model.parameter_groups()
    params = dict(model.named_parameters())
    assert rows and set(rows) <= set(params)
    x = torch.randn(4, *shape)
    for c in range(0, classes, 3):
        model.zero_grad()
        model(x)[:, c].sum().backward()
        g = int(model.class_group[c])
        for key, group in rows.items():
            grad = params[key].grad
            grad = torch.zeros_like(params[key]) if grad is None else grad
            assert torch.count_nonzero(grad[group != g]) == 0, (key, c)
        own = sum(float(params[k].grad[grp == g].abs().sum()) for k, grp in rows.items() if params[k].grad is not None)
        assert own > 0  # the class's own group does learn from it


def test_classes_go_to_groups_in_blocks_or_round_robin():
    assert class_groups(10, 10).tolist() == list(range(10))
    assert class_groups(100, 10).tolist() == [c // 10 for c in range(100)]
    assert class_groups(20, 10, "round_robin").tolist() == [c % 10 for c in range(20)]
    assert sorted(set(class_groups(10, 4).tolist())) == [0, 1, 2, 3]


def test_the_adapted_vgg9_has_the_parameter_count_its_grouping_implies():
    model = grouped("vgg9", (3, 32, 32), 10, norm="none")
    conv = lambda cin, cout, groups=1: cin // groups * cout * 9 + cout  # noqa: E731
    expected = (conv(3, 32) + conv(32, 64) + conv(64, 128)  # shared
                + conv(128, 130)  # first grouped layer: reads all 128 shared channels, 10 groups of 13 out
                + conv(130, 260, 10) + conv(260, 260, 10)  # grouped convolutions (256 -> 260)
                + 10 * (26 * 4 * 4 * 52 + 52) + 10 * (52 * 52 + 52)  # block-diagonal fc (512 -> 520)
                + 10 * (52 * 1 + 1))  # decoupled classifier: one class per group
    assert sum(p.numel() for p in model.parameters()) == expected
    plain = build_model("vgg9", (3, 32, 32), 10)  # FedMA's VGG-9
    assert sum(p.numel() for p in plain.parameters()) == 3_491_530
    gn = grouped("vgg9", (3, 32, 32), 10, norm="group")  # GroupNorm adds a scale and shift per channel
    assert sum(p.numel() for p in gn.parameters()) - expected == 2 * (32 + 64 + 128 + 130 + 260 + 260)


def test_group_weighted_mean_is_the_hand_computed_mean_per_group_and_keeps_unheld_groups():
    like = {"shared": torch.zeros(2), "w": torch.full((3, 2), 9.0), "count": torch.tensor(0)}
    rows = {"w": torch.tensor([0, 1, 2])}  # row r belongs to group r
    mean = GroupWeightedMean(rows)
    mean.add({"shared": torch.tensor([1.0, 2.0]), "w": torch.ones(3, 2), "count": torch.tensor(3)}, 10, [4, 6, 0])
    mean.add({"shared": torch.tensor([3.0, 6.0]), "w": 3 * torch.ones(3, 2), "count": torch.tensor(5)}, 30, [0, 30, 0])
    out = mean.result(like)
    assert torch.allclose(out["shared"], torch.tensor([(10 * 1 + 30 * 3) / 40, (10 * 2 + 30 * 6) / 40]))
    assert torch.allclose(out["w"][0], torch.ones(2))  # only client 1 holds group 0
    assert torch.allclose(out["w"][1], torch.full((2,), (6 * 1 + 30 * 3) / 36))
    assert torch.equal(out["w"][2], like["w"][2])  # nobody holds group 2: unchanged
    assert int(out["count"]) == 5


def fed2_after_setup(*overrides):
    """Fed2 on 8x8 inputs and 10 classes with 5 groups, set up; its model's state before any round."""
    cfg = load_config(overrides=["algorithm=fed2", "dataset=digits", "fed2.groups=5", "num_clients=2", *overrides])
    algo = set_up(cfg, None, (1, 8, 8), 10)
    assert isinstance(algo, Fed2)
    return algo, cpu_state(algo.model)


def client_results(before, clients):
    """ClientResults whose weights are `before` + (cid + 1), with (samples, samples per group) each."""
    return [ClientResult(cid, n, {"weights": {k: (v + cid + 1 if v.is_floating_point() else v) for k, v in before.items()},
                                  "group_samples": held}, {"loss": 1.0}) for cid, (n, held) in enumerate(clients)]


def test_fed2_pairs_groups_over_their_holders_shared_buffers_take_the_plain_mean():
    algo, before = fed2_after_setup("fed2.norm=batch", "fed2.pairing=holders")
    rows = algo.row_groups
    key = next(k for k in rows if k.startswith("head."))  # group 0's classifier block
    bn = next(k for k in before if k.endswith("running_mean"))
    shared = "encoder.0.0.weight"
    assert shared not in rows
    results = client_results(before, [(10, [10, 0, 0, 0, 0]), (30, [20, 10, 0, 0, 0])])
    metrics = algo.aggregate(1, iter(results))
    after = algo.model.state_dict()
    s0, s1 = (r.update["weights"] for r in results)
    assert torch.allclose(after[shared], (10 * s0[shared] + 30 * s1[shared]) / 40)  # FedAvg
    assert torch.allclose(after[bn], (10 * s0[bn] + 30 * s1[bn]) / 40)  # a shared layer's buffer: plain mean
    g0 = rows[key] == 0
    assert torch.allclose(after[key][g0], (10 * s0[key][g0] + 20 * s1[key][g0]) / 30)  # group 0: by its samples
    g1 = next(k for k in rows if rows[k].numel() and bool((rows[k] == 1).all()) and k.startswith("head."))
    assert torch.allclose(after[g1], s1[g1])  # group 1: only client 1 holds it
    g4 = next(k for k in rows if k.startswith("head.") and bool((rows[k] == 4).all()))
    assert torch.equal(after[g4], before[g4])  # nobody holds group 4's classes: unchanged
    assert metrics["groups_held"] == 2
    grouped_bn = next(k for k in rows if k.endswith("running_mean"))  # a grouped layer's statistics go with their group
    assert torch.allclose(after[grouped_bn][rows[grouped_bn] == 1], s1[grouped_bn][rows[grouped_bn] == 1])
    assert torch.equal(after[grouped_bn][rows[grouped_bn] == 4], before[grouped_bn][rows[grouped_bn] == 4])


def test_classifier_all_averages_the_decoupled_classifier_over_every_client():
    algo, before = fed2_after_setup("fed2.pairing=holders", "fed2.classifier=all")
    assert not any(k.startswith("head.") for k in algo.row_groups) and algo.row_groups  # features still paired
    results = client_results(before, [(10, [10, 0, 0, 0, 0]), (30, [0, 30, 0, 0, 0])])
    algo.aggregate(1, iter(results))
    after = algo.model.state_dict()
    head = "head.heads.4.weight"  # group 4: nobody holds its classes, yet both clients' updates count
    assert torch.allclose(after[head], before[head] + (10 * 1 + 30 * 2) / 40)


def test_structure_pairing_averages_every_group_over_every_client_by_samples():
    """The default reading: group g of every model carries the same classes, so it is
    averaged with group g of every model, as FedAvg would, whoever holds its classes."""
    algo, before = fed2_after_setup("fed2.norm=batch")
    assert algo.row_groups == {}
    results = client_results(before, [(10, [10, 0, 0, 0, 0]), (30, [20, 10, 0, 0, 0])])
    metrics = algo.aggregate(1, iter(results))
    after = algo.model.state_dict()
    for k, v in before.items():  # client i sent before + i + 1: every float entry moves by (10*1 + 30*2) / 40
        if v.is_floating_point():
            assert torch.allclose(after[k], v + 1.75), k
    assert metrics["groups_held"] == 2


def test_absent_freeze_leaves_the_feature_groups_of_classes_the_client_lacks_as_received():
    """fed2.absent=freeze: a client holding classes 0-3 (groups 0 and 1 of 5) trains the shared
    layers, groups 0-1 and every classifier head; the feature rows of groups 2-4 come back
    exactly as sent (weight decay on, so a zeroed gradient alone would not keep them)."""
    from raysim.contract import Client

    algo, before = fed2_after_setup("fed2.absent=freeze", "fed2.norm=batch", "local.weight_decay=0.01",
                                    "local.batch_size=8")
    model = algo.build_model((1, 8, 8))
    torch.manual_seed(1)
    x, y = torch.randn(32, 1, 8, 8), torch.arange(32) % 4
    client = Client(0, 1, algo.cfg, x, y, 10, torch.device("cpu"), torch.Generator().manual_seed(0), {}, model)
    result = algo.client_update(client, {"weights": before})
    after, rows = result.update["weights"], model.parameter_groups(buffers=True)
    assert result.update["group_samples"] == [16, 16, 0, 0, 0]
    features = [k for k in rows if not k.startswith("head.")]
    assert features and any(k.endswith("running_mean") for k in features)
    for k in features:
        absent = rows[k] >= 2
        assert torch.equal(after[k][absent], before[k][absent]), k
        assert not torch.equal(after[k][~absent], before[k][~absent]), k  # its own groups learn
    for g in range(5):  # every class's logit still hears the client: the push-down on absent classes
        assert not torch.equal(after[f"head.heads.{g}.weight"], before[f"head.heads.{g}.weight"])
    assert not torch.equal(after["encoder.0.0.weight"], before["encoder.0.0.weight"])  # shared layers train
    trained = Fed2(load_config(overrides=["algorithm=fed2", "dataset=digits", "fed2.groups=5", "fed2.norm=batch",
                                          "local.weight_decay=0.01", "local.batch_size=8"]), 10, (1, 8, 8))
    model.load_state_dict(before)
    client = Client(0, 1, trained.cfg, x, y, 10, torch.device("cpu"), torch.Generator().manual_seed(0), {}, model)
    default = trained.client_update(client, {"weights": before}).update["weights"]
    assert any(not torch.equal(default[k][rows[k] >= 2], before[k][rows[k] >= 2]) for k in features)  # train: they move


def test_the_nx5_partition_gives_every_node_exactly_five_classes():
    from raysim.data.partition import make_partition

    y = np.repeat(np.arange(10), 1000)
    for n in (10, 20, 50):
        cfg = load_config(overrides=["partition=classes", "partition.k=5", f"num_clients={n}"])
        part = make_partition(y, cfg, 10)
        held = [set(y[ix].tolist()) for ix in part.train]
        assert all(len(h) == 5 for h in held) and set().union(*held) == set(range(10))


COMMON = ["algorithm=fed2", "dataset=digits", "model=vgg9", "num_clients=8", "participation=0.5",
          "partition=classes", "partition.k=5", "local.epochs=1", "fed2.groups=5"]


def test_fed2_gives_the_same_model_with_1_and_3_actors(ray_local, tmp_path):
    for n in (1, 3):
        assert main([*COMMON, "rounds=2", f"resources.num_actors={n}", f"output_dir={tmp_path}", f"run_name=a{n}",
                     "--quiet"]) == 0
    a, b = (torch.load(tmp_path / f"a{n}" / "model.pt", weights_only=True)["global"] for n in (1, 3))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fed2_by_default_is_fedavg_on_the_adapted_network(ray_local, tmp_path):
    """Structure pairing: Fed2's aggregation is FedAvg's, so its models equal FedAvg's on the
    same grouped network bit for bit; the holders reading gives other models."""
    runs = {"fed2": [*COMMON], "holders": [*COMMON, "fed2.pairing=holders"],
            "fedavg": [*(a for a in COMMON if not a.startswith(("algorithm", "fed2"))), "algorithm=fedavg",
                       "model_options.groups=5", "model_options.grouped_layers=6", "model_options.norm=group",
                       "local.lr=0.01"]}  # fed2's config group sets lr 0.01
    for name, args in runs.items():
        assert main([*args, "rounds=2", f"output_dir={tmp_path}", f"run_name={name}", "--quiet"]) == 0
    fed2, holders, fedavg = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in runs)
    assert set(fed2) == set(fedavg) and all(torch.equal(fed2[k], fedavg[k]) for k in fed2)
    assert not all(torch.equal(fed2[k], holders[k]) for k in fed2)


def test_fed2_resumed_mid_run_gives_the_same_model(ray_local, tmp_path):
    common = [*COMMON, "checkpoint_every=1", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=1", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=3", "--quiet"]) == 0
    assert main([*common, "rounds=3", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("part", "whole"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_moon_builds_its_projection_network_through_the_same_hook():
    cfg = load_config(overrides=["algorithm=moon", "dataset=digits", "model=mlp"])
    from raysim.algorithms.moon import Moon

    out_dim = int(OmegaConf.select(cfg, "moon.out_dim"))
    torch.manual_seed(0)
    net = Moon(cfg, 10, (1, 8, 8)).build_model((1, 8, 8))
    torch.manual_seed(0)
    plain = build_model("mlp", (1, 8, 8), 10)
    # default: the configured model untouched, the projection beside it
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in plain.state_dict().items())
    assert net.projection(net.encoder(torch.randn(3, 1, 8, 8))).shape == (3, out_dim)
    cfg.moon.classifier = "projection"  # the authors' chain: the classifier reads the projection
    net = Moon(cfg, 10, (1, 8, 8)).build_model((1, 8, 8))
    assert net.feature_dim == out_dim and net.head.in_features == out_dim


def test_the_analysis_tool_writes_a_table_and_picture_and_sees_the_grouped_layers_aligned(ray_local, tmp_path):
    from raysim.results.analysis import main as analyse

    assert main([*COMMON, "rounds=2", f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    assert analyse([str(tmp_path / "r"), "--per-class", "20"]) == 0
    out = tmp_path / "r" / "analysis"
    import csv

    rows = list(csv.DictReader(open(out / "layers.csv")))
    assert len(rows) == 8  # VGG-9's convolutions and hidden fully connected layers
    grouped = [r for r in rows if r["aligned"] != ""]
    assert len(grouped) == 5  # L = 6 grouped layers, the classifier being the sixth
    assert all(float(r["aligned"]) == 1.0 for r in grouped)  # logit gradients reach only a neuron's own group
    assert all(0 <= float(r["total_variance"]) <= 1 - 1 / 10 + 1e-6 for r in rows)
    png = (out / "preferences.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    n_neurons = sum(int(r["neurons"]) for r in rows)
    assert sum(1 for _ in open(out / "preferences.csv")) == n_neurons + 1


def test_the_analysis_tool_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    from raysim.results.analysis import main as analyse

    assert analyse([str(tmp_path)]) == 2
    assert "config.yaml not found" in capsys.readouterr().err
