"""Algorithms against their definitions (ALGORITHMS.md), on tensors small enough to check by hand."""
import numpy as np
import torch

from raysim.algorithms.fedavg import FedAvg
from raysim.algorithms.fedavgm import FedAvgM
from raysim.algorithms.fedprox import FedProx, proximal_loss
from raysim.contract import Client, ClientResult
from raysim.config import load_config
from raysim.testing import set_up
from raysim.training import WeightedMean, cpu_state, cross_entropy, local_sgd


def linear():
    """A fixed 2 -> 1 linear model."""
    m = torch.nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0]]))
        m.bias.fill_(0.5)
    return m


def results(*pairs):
    return iter([ClientResult(i, n, {"weight": torch.tensor([w]), "bias": torch.tensor([b])}, {"loss": 0.0})
                 for i, (n, w, b) in enumerate(pairs)])


def test_fedavg_is_the_sample_weighted_mean():
    algo = set_up(load_config(), linear, num_classes=1)
    algo.aggregate(1, results((10, [1.0, 0.0], 1.0), (30, [5.0, 4.0], -1.0)))
    assert torch.allclose(algo.model.weight, torch.tensor([[4.0, 3.0]]))  # (10*1 + 30*5)/40, (0 + 30*4)/40
    assert torch.allclose(algo.model.bias, torch.tensor([-0.5]))  # (10 - 30)/40


def test_fedavg_keeps_the_model_when_every_client_dropped():
    algo = set_up(load_config(), linear, num_classes=1)
    before = cpu_state(algo.model)
    algo.aggregate(1, iter([]))
    assert all(torch.equal(before[k], v) for k, v in algo.model.state_dict().items())


def test_weighted_mean_integer_buffers_take_the_max():
    wm = WeightedMean()
    wm.add({"f": torch.tensor([1.0]), "n": torch.tensor(3)}, 1)
    wm.add({"f": torch.tensor([3.0]), "n": torch.tensor(5)}, 3)
    out = wm.result({"f": torch.tensor([0.0]), "n": torch.tensor(0)})
    assert out["f"].item() == 2.5 and out["n"].item() == 5 and out["n"].dtype == torch.int64


def test_fedavgm_server_momentum():
    cfg = load_config(overrides=["algorithm=fedavgm", "fedavgm.beta=0.5", "fedavgm.server_lr=1.0"])
    algo = set_up(cfg, linear, num_classes=1)
    assert isinstance(algo, FedAvgM)
    # round 1: average w = [0, 0]; delta = [1, 2]; v = delta; w = [1,2] - [1,2] = [0, 0]
    algo.aggregate(1, results((1, [0.0, 0.0], 0.5)))
    assert torch.allclose(algo.model.weight, torch.tensor([[0.0, 0.0]]))
    # round 2: average w = [1, 1]; delta = [-1, -1]; v = 0.5*[1,2] + [-1,-1] = [-0.5, 0]; w = [0.5, 0]
    algo.aggregate(2, results((1, [1.0, 1.0], 0.5)))
    assert torch.allclose(algo.model.weight, torch.tensor([[0.5, 0.0]]))


def make_client(cfg, model, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = (x[:, 0] > 0).long()
    return Client(0, 1, cfg, x, y, 2, torch.device("cpu"), torch.Generator().manual_seed(seed), {}, model,
                  epochs=int(cfg.local.epochs))


def test_fedprox_loss_adds_the_proximal_term():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    global_params = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.weight.add_(torch.tensor([[0.1, -0.2], [0.3, 0.0]]))
        model.bias.add_(torch.tensor([0.4, 0.0]))
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    mu = 0.7
    expected = cross_entropy(model, x, y) + mu / 2 * (0.01 + 0.04 + 0.09 + 0.16)
    assert torch.allclose(proximal_loss(mu, global_params)(model, x, y), expected)


def test_fedprox_stays_closer_to_the_global_model():
    def drift(mu):
        cfg = load_config(overrides=["algorithm=fedprox", f"fedprox.mu={mu}", "local.epochs=5", "local.lr=0.1"])
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        start = cpu_state(model)
        client = make_client(cfg, model)
        res = FedProx(cfg, 2, (2,)).client_update(client, {"weights": start})
        return sum(float(((res.update[k] - start[k]) ** 2).sum()) for k in start)

    assert drift(1.0) < 0.5 * drift(0.0)
    assert drift(0.0) > 0


def test_local_sgd_is_a_function_of_the_seed():
    cfg = load_config(overrides=["local.epochs=2", "local.batch_size=8"])

    def train(seed):
        torch.manual_seed(1)
        model = torch.nn.Linear(2, 2)
        local_sgd(make_client(cfg, model, seed=seed), model)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(train(0), train(0))
    assert not torch.equal(train(0), train(1))


def test_local_sgd_steps_and_lr_decay():
    cfg = load_config(overrides=["local.steps=3", "local.batch_size=4", "local.lr_decay=0.5"])
    model = torch.nn.Linear(2, 2)
    stats = local_sgd(make_client(cfg, model), model)
    assert stats["steps"] == 3
    from raysim.training import round_lr
    assert round_lr(cfg.local, 3) == cfg.local.lr * 0.25


def test_sgd_matches_torch_optim_sgd_exactly():
    from raysim.training import SGD

    def train(opt_cls):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
        opt = opt_cls(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            cross_entropy(model, x, y).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    for a, b in zip(train(SGD), train(torch.optim.SGD)):
        assert torch.equal(a, b)


def test_wire_round_trip_keeps_tensors_and_arrays_apart():
    import pickle

    from raysim.wire import pack, unpack

    r = ClientResult(3, 10, {"w": torch.arange(6.0).reshape(2, 3), "counts": np.array([1, 2])}, {"loss": 0.5})
    back = unpack(pickle.loads(pickle.dumps(pack(r))))
    assert isinstance(back.update["w"], torch.Tensor) and torch.equal(back.update["w"], r.update["w"])
    assert isinstance(back.update["counts"], np.ndarray)
    assert back.cid == 3 and back.metrics == {"loss": 0.5}
    # a group sum's per-client lines travel unwalked (wire.Lines), and come back as they went
    from raysim.wire import Lines

    lines = Lines((c, 10, {"loss": 0.1 * c, "label_counts": np.array([c, 1])}, False) for c in range(3))
    packed = pack(ClientResult(0, 30, r.update, {"loss": 0.1}, clients=lines))
    assert packed.clients is lines  # not walked: the same object
    again = unpack(pickle.loads(pickle.dumps(packed)))
    assert type(again.clients) is Lines and [c for c, *_ in again.clients] == [0, 1, 2]
    assert again.clients[2][2]["label_counts"].tolist() == [2, 1]


def test_colour_augment_flips_greys_and_keeps_the_standardisation():
    from raysim.data.augment import ColourAugment

    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    aug = ColourAugment(mean, std, jitter=0.0, flip=1.0, grey=0.0)  # only flips
    x = torch.randn(4, 3, 8, 8)
    assert torch.allclose(aug(x.clamp(-1, 1), torch.Generator().manual_seed(0)), x.clamp(-1, 1).flip(-1), atol=1e-5)
    grey = ColourAugment(mean, std, jitter=0.0, flip=0.0, grey=1.0)(x, torch.Generator().manual_seed(0))
    raw = grey * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    assert torch.allclose(raw[:, 0], raw[:, 1], atol=1e-5) and torch.allclose(raw[:, 1], raw[:, 2], atol=1e-5)
    full = ColourAugment(mean, std)
    a, b = full(x, torch.Generator().manual_seed(3)), full(x, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and not torch.equal(a, full(x, torch.Generator().manual_seed(4)))
    raw = a * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5  # pixels stay in [0, 1]


def test_crop_flip_is_a_reflect_padded_crop_maybe_flipped():
    """NIID-Bench's CIFAR augmentation: every output image is one 32x32 window of the
    reflect-padded (4 px) input, mirrored or not; offsets and flips vary across images."""
    import torch.nn.functional as F

    from raysim.data.augment import CropFlip

    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    out = CropFlip()(x, torch.Generator().manual_seed(1))
    padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
    seen = set()
    for i in range(len(x)):
        found = [(dy, dx, f) for dy in range(9) for dx in range(9) for f in (False, True)
                 if torch.equal(out[i], (lambda w: w.flip(-1) if f else w)(padded[i, :, dy:dy + 32, dx:dx + 32]))]
        assert found, i
        seen.add(found[0])
    assert len(seen) > 8 and {f for _, _, f in seen} == {False, True}
    again = CropFlip()(x, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)  # drawn from the client's generator only
    assert torch.equal(CropFlip(pad=0, flip=0.0)(x, torch.Generator()), x)
