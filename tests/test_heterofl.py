"""HeteroFL (algorithms/heterofl.py): width-sliced sub-models of the zoo's models, the
element-wise mean over the clients holding each element, by hand; the client rates; it learns
on digits with the same bits on 2 actors, in process and resumed."""
import pytest
import torch

from raysim.algorithms.heterofl import HeteroFL, client_rate, leading, rolled
from raysim.config import load_config
from raysim.contract import ClientResult
from raysim.models import build_model
from raysim.run import main
from raysim.testing import set_up


@pytest.mark.parametrize("model,shape", [("cnn", (1, 28, 28)), ("mlp", (64,)), ("vgg9", (1, 28, 28))])
def test_a_sub_model_is_the_leading_block_of_every_layer(model, shape):
    """Zero every weight of the whole model outside the leading blocks of the rate-1/2 model:
    the units outside get no input, so the whole model computes exactly what the sub-model,
    loaded with the leading slices, computes (conv channels before a Linear are read
    channel-major: the first channels' positions first)."""
    torch.manual_seed(0)
    full = build_model(model, shape, 10)
    half = build_model(model, shape, 10, {"width": 0.5})
    state = full.state_dict()
    for k, v in half.state_dict().items():
        keep = torch.zeros_like(state[k])
        keep[leading(state[k], v.shape)] = 1
        state[k] = state[k] * keep
    full.load_state_dict(state)
    half.load_state_dict(HeteroFL.cut(state, half))
    x = torch.randn(5, *shape)
    assert torch.allclose(full(x), half(x), atol=1e-5)
    assert sum(p.numel() for p in half.parameters()) < 0.4 * sum(p.numel() for p in full.parameters())


@pytest.mark.parametrize("model,shape,norm", [("cnn", (1, 28, 28), "none"), ("mlp", (64,), "batch"),
                                              ("vgg9", (1, 28, 28), "batch")])
def test_fedrolex_windows_pick_a_sub_model_of_the_whole_one(model, shape, norm):
    """FedRolex's round-7 windows: zero every weight outside them and the whole model computes
    what the rate-1/2 sub-model loaded from them computes (units (7 + i) mod K of each layer,
    their positions after the Flatten); offset 0 is HeteroFL's leading block."""
    torch.manual_seed(0)
    full = build_model(model, shape, 10, {"norm": norm})
    half = build_model(model, shape, 10, {"norm": norm, "width": 0.5})
    state = full.state_dict()
    shapes = {k: v.shape for k, v in half.state_dict().items()}
    lead = HeteroFL.cut(state, half, rolled(state, shapes, 0))
    assert all(torch.equal(lead[k], v) for k, v in HeteroFL.cut(state, half).items())
    windows = rolled(state, shapes, 7)
    first = next(k for k in state if k.endswith("weight"))
    assert not torch.equal(HeteroFL.cut(state, half, windows)[first], lead[first])  # it rolled
    for k, at in windows.items():
        if state[k].dim() and state[k].is_floating_point() and not k.endswith("running_var"):
            keep = torch.zeros_like(state[k])
            keep[at] = 1
            state[k] = state[k] * keep
    full.load_state_dict(state)
    half.load_state_dict(HeteroFL.cut(state, half, windows))
    full.eval(), half.eval()
    x = torch.randn(5, *shape)
    assert torch.allclose(full(x), half(x), atol=1e-5)


def test_each_element_is_the_mean_of_the_clients_holding_it_and_the_rest_stays():
    """mlp 2-4-3; client A at rate 1, client B at rate 1/2 (hidden 2). Hidden rows 0-1: the
    mean of A's and B's; rows 2-3: A's alone. With masking, head rows of classes a client
    lacks are not taken from it: B holds class 0 only, so head rows 1-2 are A's; A holds
    classes 0 and 1, so row 2 is no one's: it keeps the server's value."""
    cfg = load_config(overrides=["algorithm=heterofl", "model=mlp", "model_options.hidden=[4]", "num_clients=2",
                                 "heterofl.rates=[1.0,0.5]", "heterofl.proportions=[0.5,0.5]"])
    algo = set_up(cfg, None, (2,), 3)
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    a = {k: torch.full_like(v, 2.0) for k, v in before.items()}
    b = {"encoder.1.weight": torch.full((2, 2), 4.0), "encoder.1.bias": torch.full((2,), 4.0),
         "head.weight": torch.full((3, 2), 4.0), "head.bias": torch.full((3,), 4.0)}
    algo.aggregate(1, iter([ClientResult(0, 10, {**a, "classes": torch.tensor([0, 1])}, {"loss": 1.0}),
                            ClientResult(1, 30, {**b, "classes": torch.tensor([0])}, {"loss": 1.0})]))
    now = algo.model.state_dict()
    assert torch.equal(now["encoder.1.weight"][:2], torch.full((2, 2), 3.0))
    assert torch.equal(now["encoder.1.weight"][2:], torch.full((2, 2), 2.0))
    assert torch.equal(now["head.weight"][0], torch.tensor([3.0, 3.0, 2.0, 2.0]))  # both hold class 0 (B: 2 columns)
    assert torch.equal(now["head.weight"][1], torch.full((4,), 2.0))  # A's alone
    assert torch.equal(now["head.weight"][2], before["head.weight"][2])  # no one's: as it was
    assert torch.equal(now["head.bias"], torch.tensor([3.0, 2.0, float(before["head.bias"][2])]))
    half = algo.eval_models()["width_0.5"].state_dict()
    assert torch.equal(half["encoder.1.weight"], now["encoder.1.weight"][:2, :])  # the evaluated cut follows


def test_sample_weighting_and_no_mask():
    cfg = load_config(overrides=["algorithm=heterofl", "model=mlp", "model_options.hidden=[4]", "num_clients=2",
                                 "heterofl.weighting=samples", "heterofl.mask=false"])
    algo = set_up(cfg, None, (2,), 3)
    a = {k: torch.full_like(v, 2.0) for k, v in algo.model.state_dict().items()}
    b = {"encoder.1.weight": torch.full((2, 2), 4.0), "encoder.1.bias": torch.full((2,), 4.0),
         "head.weight": torch.full((3, 2), 4.0), "head.bias": torch.full((3,), 4.0)}
    algo.aggregate(1, iter([ClientResult(0, 10, a, {"loss": 1.0}), ClientResult(1, 30, b, {"loss": 1.0})]))
    now = algo.model.state_dict()
    assert torch.allclose(now["encoder.1.weight"][:2], torch.full((2, 2), 3.5))  # (2 * 10 + 4 * 30) / 40
    assert torch.allclose(now["head.bias"], torch.full((3,), 3.5))


def test_client_rates_are_fixed_per_client_and_follow_the_proportions():
    cfg = load_config(overrides=["algorithm=heterofl", "model=mlp", "heterofl.rates=[1.0,0.25]",
                                 "heterofl.proportions=[0.25,0.75]"])
    rates = [client_rate(cfg, c) for c in range(400)]
    assert rates == [client_rate(cfg, c) for c in range(400)]
    assert set(rates) == {1.0, 0.25} and 0.65 < rates.count(0.25) / 400 < 0.85
    other = load_config(overrides=["algorithm=heterofl", "model=mlp", "seed=1", "heterofl.rates=[1.0,0.25]",
                                   "heterofl.proportions=[0.25,0.75]"])
    assert [client_rate(other, c) for c in range(400)] != rates


def test_a_model_without_width_and_bad_rates_are_one_line(capsys, tmp_path):
    from raysim.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm=heterofl: model='resnet8' has no width option"):
        load_config(overrides=["algorithm=heterofl", "model=resnet8"])
    with pytest.raises(ConfigError, match="model_options.norm=group normalises groups of channels"):
        load_config(overrides=["algorithm=heterofl", "model=cnn", "model_options.norm=group"])
    with pytest.raises(ConfigError, match=r"heterofl.rates must be in \(0, 1\]"):
        load_config(overrides=["algorithm=heterofl", "heterofl.rates=[1.0,2.0]", "heterofl.proportions=[0.5,0.5]"])
    with pytest.raises(ConfigError, match="same length"):
        load_config(overrides=["algorithm=heterofl", "heterofl.rates=[1.0]"])


def test_fjords_step_at_a_narrower_width_is_the_sub_models_written_into_the_leading_block():
    """Ordered dropout: the loss of the width-1/2 sub-model of a client's whole model,
    computed on its leading slices, gives the whole model the half model's gradient in the
    leading blocks and 0 elsewhere."""
    from raysim.training import new_client

    cfg = load_config(overrides=["algorithm=heterofl", "heterofl.variant=fjord", "model=mlp",
                                 "model_options.hidden=[8]", "heterofl.rates=[1.0,0.5]",
                                 "heterofl.proportions=[0.5,0.5]"])
    algo = set_up(cfg, None, (4,), 3)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    torch.manual_seed(1)
    whole = build_model("mlp", (4,), 3, {"hidden": [8]})
    client = new_client(cfg, 1, 0, x, y, 3, {}, whole, epochs=1)
    narrow = algo.narrowed(client, whole, 0.5, 1.0)
    torch.nn.functional.cross_entropy(narrow(x), y).backward()
    half = build_model("mlp", (4,), 3, {"hidden": [8], "width": 0.5})
    half.load_state_dict(HeteroFL.cut(whole.state_dict(), half))
    torch.nn.functional.cross_entropy(half(x), y).backward()
    for (n, p), (_, q) in zip(whole.named_parameters(), half.named_parameters()):
        at = leading(p, q.shape)
        assert torch.allclose(p.grad[at], q.grad, atol=1e-6), n
        outside = p.grad.clone()
        outside[at] = 0
        assert torch.count_nonzero(outside) == 0, n


@pytest.mark.parametrize("variant", ["heterofl", "fjord", "fedrolex"])
def test_heterofl_learns_on_digits_with_the_same_bits_on_any_actors_and_resumed(ray_local, tmp_path, variant):
    import pyarrow.parquet as pq
    from same_bits import same_bits_on_ray_and_in_process

    common = ["algorithm=heterofl", "dataset=digits", "model=mlp", "num_clients=10", "participation=0.5",
              "rounds=3", "heterofl.rates=[1.0,0.5,0.25]", "heterofl.proportions=[0.4,0.3,0.3]",
              f"heterofl.variant={variant}"]
    models, rows = same_bits_on_ray_and_in_process(tmp_path, common, (2,))
    assert {r["cid"] for r in rows[0]} and len(rows[0]) == 15
    assert main([*common, "rounds=2", "checkpoint_every=2", f"output_dir={tmp_path}", "run_name=part", "--quiet"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=3", "--quiet"]) == 0
    resumed = torch.load(tmp_path / "part" / "model.pt", weights_only=True)["global"]
    assert all(torch.equal(models[0][k], resumed[k]) for k in resumed)
    assert main([*common, "rounds=12", "participation=1.0", f"output_dir={tmp_path}", "run_name=learn", "--quiet"]) == 0
    curve = pq.read_table(tmp_path / "learn" / "metrics.parquet").to_pylist()
    last = [r["accuracy"] for r in curve[-3:]]
    assert sum(last) / 3 > 0.8, [r["accuracy"] for r in curve]
    assert curve[-1]["width_0.5_accuracy"] > 0.3  # the half-width cut of the global model learns too


@pytest.mark.parametrize("variant,scaled", [("heterofl", True), ("fedrolex", True), ("fjord", False)])
def test_the_scaler_divides_a_narrow_clients_hidden_outputs_by_its_rate_in_training(variant, scaled):
    """The authors' Scaler (HeteroFL's and FedRolex's, `heterofl.scaler=true`; FjORD has none):
    mlp 4-8-3 at rate 1/2 (hidden 4). In training the hidden layer's output is divided by 1/2,
    so (through the ReLU) the head reads twice the evaluation's features; in evaluation it is
    as it is. (Before issue 71 FedRolex never applied it: its train and eval outputs agreed.)"""
    from raysim.training import new_client

    cfg = load_config(overrides=["algorithm=heterofl", f"heterofl.variant={variant}", "model=mlp",
                                 "model_options.hidden=[8]", "heterofl.rates=[1.0,0.5]",
                                 "heterofl.proportions=[0.5,0.5]"])
    algo = set_up(cfg, None, (4,), 3)
    x = torch.randn(6, 4)
    client = new_client(cfg, 1, 0, x, torch.zeros(6, dtype=torch.long), 3, {}, build_model("mlp", (4,), 3,
                                                                                           {"hidden": [8]}), epochs=1)
    half = algo._scratch(client, 0.5)
    half.eval()
    features = half.encoder(x)
    assert torch.equal(half(x), half.head(features))
    half.train()
    expected = half.head(features / 0.5) if scaled else half.head(features)
    assert torch.allclose(half(x), expected, atol=1e-6)
    assert scaled == (not torch.allclose(half(x), half.head(features), atol=1e-4))


def test_a_clients_loss_zeroes_the_logits_of_the_classes_it_lacks():
    """heterofl.mask (the authors' default): a client holding classes 0 and 2 of 3 trains on
    the cross-entropy of logits whose class-1 column is 0 (not dropped, not -inf: the authors'
    `masked_fill(label_mask == 0, 0)`); with mask=false, the plain cross-entropy."""
    import torch.nn.functional as F

    from raysim.training import new_client

    cfg = load_config(overrides=["algorithm=heterofl", "model=mlp", "model_options.hidden=[8]"])
    algo = set_up(cfg, None, (4,), 3)
    torch.manual_seed(3)
    model = build_model("mlp", (4,), 3, {"hidden": [8]})
    x, y = torch.randn(6, 4), torch.tensor([0, 2, 2, 0, 0, 2])
    client = new_client(cfg, 1, 0, x, y, 3, {}, model, epochs=1)
    logits = model(x)
    masked = logits.clone()
    masked[:, 1] = 0.0
    got = algo.local_loss_for(client, torch.tensor([0, 2]))(model, x, y)
    assert torch.allclose(got, F.cross_entropy(masked, y), atol=1e-6)
    assert not torch.allclose(got, F.cross_entropy(logits, y), atol=1e-4)
    plain = set_up(load_config(overrides=["algorithm=heterofl", "model=mlp", "heterofl.mask=false"]), None, (4,), 3)
    assert torch.allclose(plain.local_loss_for(client, None)(model, x, y), F.cross_entropy(logits, y), atol=1e-6)


def test_fedrolex_rolls_forward_as_the_paper_or_backward_as_the_authors_code():
    """Hidden layer of 8, rate 1/2 (4 units), round 3: the paper's Eq. 4 keeps units 3..6; the
    authors' `torch.roll(arange(8), 3)[:4]` keeps 5, 6, 7, 0 (units (i - 3) mod 8)."""
    def kept(roll):
        cfg = load_config(overrides=["algorithm=heterofl", "heterofl.variant=fedrolex", f"heterofl.roll={roll}",
                                     "model=mlp", "model_options.hidden=[8]"])
        full = build_model("mlp", (4,), 3, {"hidden": [8]}).state_dict()
        half = build_model("mlp", (4,), 3, {"hidden": [8], "width": 0.5}).state_dict()
        at = rolled(full, {k: v.shape for k, v in half.items()}, HeteroFL.window_offset(cfg, 3))
        return sorted(int(u) for u in at["encoder.1.bias"][0])

    assert kept("paper") == [3, 4, 5, 6]
    assert kept("code") == sorted(int(u) for u in torch.roll(torch.arange(8), 3)[:4]) == [0, 5, 6, 7]


def test_static_batchnorm_statistics_are_the_mean_over_every_clients_batches_as_the_authors_stats_pass():
    """heterofl.norm=static (the authors' sBN, train_classifier_fed.py `stats`): before an
    evaluation, each evaluated width's BatchNorm statistics are the cumulative average over
    the batches of every client's training data passed through it in training mode: here,
    by hand, the mean over all batches of each batch's mean (and unbiased variance) of the
    BatchNorm layer's input, for the whole model and the half-width one."""
    from raysim.testing import InProcessServer

    cfg = load_config(overrides=["algorithm=heterofl", "model=mlp", "model_options.hidden=[16]",
                                 "model_options.norm=batch", "heterofl.norm=static", "heterofl.rates=[1.0,0.5]",
                                 "heterofl.proportions=[0.5,0.5]", "num_clients=4", "participation=0.5",
                                 "local.batch_size=32", "eval_every=1", "rounds=1"])
    server = InProcessServer.from_config(cfg)
    server.setup()
    server.round(1)
    algo = server.algorithm
    for rate, model in ((1.0, algo.model), (0.5, algo.sub_models[0.5])):
        linear = model.encoder[1]
        means, variances = [], []
        for cid in range(4):  # every client, not only the round's
            x = server.data[cid][0]
            for start in range(0, len(x), 32):
                z = linear(x[start:start + 32].flatten(1)).detach().double()
                if len(z) > 1:
                    means.append(z.mean(0))
                    variances.append(z.var(0, unbiased=True))
        bn = model.encoder[2]
        assert torch.allclose(bn.running_mean.double(), torch.stack(means).mean(0), atol=1e-5), rate
        assert torch.allclose(bn.running_var.double(), torch.stack(variances).mean(0), atol=1e-4), rate
        assert int(bn.num_batches_tracked) == len(means)


def test_static_batchnorm_without_batchnorm_is_one_line():
    with pytest.raises(Exception, match="heterofl.norm=static recomputes BatchNorm statistics.*model_options.norm=batch"):
        load_config(overrides=["algorithm=heterofl", "model=mlp", "heterofl.norm=static"])
