"""Every server rule that is not a plain average (FedAvgM's momentum, FedNova's
normalisation, SCAFFOLD's step) must leave buffers (BatchNorm running statistics) to the
plain sample-weighted mean of the clients' values. Real local training of a ResNet-8 with
BatchNorm, two clients of very different sizes, four rounds through each algorithm."""
import pytest
import torch

from raysim.contract import Client
from raysim.config import load_config
from raysim.testing import set_up
from raysim.training import parameter_names

SHAPE, CLASSES = (3, 8, 8), 4
SIZES = (29, 160)  # unequal sizes: unequal local steps, so FedNova's a_i differ


def client_data():
    g = torch.Generator().manual_seed(1)
    # small inputs: the clients' running variances fall well below the initial 1.0
    return [(0.3 * torch.randn(n, *SHAPE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)) for n in SIZES]


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedavgm", "scaffold", "fednova", "moon", "fedrs", "fedlc"])
def test_buffers_take_the_plain_weighted_mean(name):
    cfg = load_config(overrides=[f"algorithm={name}", "model=resnet8", "local.epochs=1", "local.batch_size=16",
                                 "local.lr=0.05", "num_clients=2"])
    algo = set_up(cfg, None, SHAPE, CLASSES)  # the configured ResNet-8, or MOON's network on it
    global_model = next(iter(algo.eval_models().values()))
    params = parameter_names(global_model)
    buffer_keys = [k for k, v in global_model.state_dict().items() if k not in params and v.is_floating_point()]
    assert any(k.endswith("running_var") for k in buffer_keys)
    scratch = algo.build_model(SHAPE)
    states = [{}, {}]
    for rnd in range(1, 5):
        payload = algo.broadcast(rnd)
        results, client_buffers = [], []
        for cid, (x, y) in enumerate(client_data()):
            client = Client(cid, rnd, cfg, x, y, CLASSES, torch.device("cpu"), torch.Generator().manual_seed(rnd * 10 + cid),
                            states[cid], scratch, epochs=1)
            results.append(algo.client_update(client, payload))
            net_state = client.model.state_dict()
            client_buffers.append({k: net_state[k].clone() for k in buffer_keys})
        algo.aggregate(rnd, iter(results))
        new = global_model.state_dict()
        for k in buffer_keys:
            expected = sum(n * b[k].double() for n, b in zip(SIZES, client_buffers)) / sum(SIZES)
            assert torch.allclose(new[k].double(), expected, atol=1e-6), f"{name}, round {rnd}: {k}"
            if k.endswith("running_var"):
                assert bool((new[k] > 0).all()), f"{name}, round {rnd}: {k} has non-positive entries"
        global_model.eval()
        assert torch.isfinite(global_model(torch.zeros(2, *SHAPE))).all()
