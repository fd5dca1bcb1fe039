"""raysim.testing.InProcessServer: the Server calls without Ray, for plugin authors' unit
tests. It is the runtime's semantics: the same config gives the same model bit for bit."""
import pytest
import torch

from raysim.config import load_config
from raysim.run import main
from raysim.testing import InProcessServer

SMALL = ["dataset=digits", "num_clients=8", "participation=0.5", "rounds=3", "local.epochs=1", "checkpoint_every=0"]


@pytest.mark.parametrize("extra", [["algorithm=fedavg"], ["algorithm=scaffold"], ["algorithm=moon"],
                                   ["algorithm=fedprox", "model=mclr", "local.vectorize=true"],
                                   ["algorithm=fedavg", "selection=fedentopt"],
                                   ["algorithm=fedprox", "server.optimizer=adam", "server.lr=0.03",
                                    "server.aggregator=median", "attack.kind=gaussian", "attack.fraction=0.25",
                                    "attack.scale=0.1"]],
                         ids=["fedavg", "scaffold-stateful", "moon-stateful", "fedprox-vectorised", "fedentopt",
                              "adam-median-attacked"])
def test_in_process_gives_the_model_a_run_on_ray_gives(ray_local, tmp_path, extra):
    torch.set_num_threads(1)  # as a client actor (resources.torch_threads)
    server = InProcessServer.from_config(load_config(overrides=[*SMALL, *extra]))
    metrics = server.run()
    assert main([*SMALL, *extra, f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    saved = torch.load(tmp_path / "r" / "model.pt")
    mine = server.algorithm.state_dict()
    assert saved.keys() == mine.keys()
    for part in saved:
        for k, v in saved[part].items():
            assert torch.equal(v, mine[part][k]), (part, k)
    assert len(metrics) == 3 and metrics[-1]["accuracy"] > 0.2
    assert [c[0] for c in server.calls if c[1] == "client_update"] == [1, 2, 3]


def test_clients_get_copies_and_a_client_that_keeps_state_without_declaring_it_is_refused():
    from raysim.algorithms.fedavg import FedAvg

    cfg = load_config(overrides=["num_clients=2", "model=mclr"])
    data = [(torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1])) for _ in range(2)]
    server = InProcessServer(cfg, data)
    server.setup()
    payload = {"weights": {k: v.clone() for k, v in server.algorithm.model.state_dict().items()}}
    before = {k: v.clone() for k, v in payload["weights"].items()}
    results = list(server.run_clients(1, [1, 0], payload))
    assert [r.cid for r in results] == [0, 1]  # client-id order
    assert all(torch.equal(before[k], v) for k, v in payload["weights"].items())  # training changed a copy

    class Forgetful(FedAvg):
        def client_update(self, client, payload):
            client.state["x"] = 1
            return super().client_update(client, payload)

    server._client_side["algorithm"] = Forgetful(cfg, 2, (4,))
    with pytest.raises(RuntimeError, match="does not declare client_state = True"):
        server.run_clients(1, [0], payload)
