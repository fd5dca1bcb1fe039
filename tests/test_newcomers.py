"""Clients that join late (issue 12): never selected before their round, then in play."""
import pyarrow.parquet as pq
import pytest

from raysim.config import ConfigError, load_config
from raysim.run import main
from raysim.world.availability import Availability


def test_newcomers_arrive_in_batches_drawn_from_the_seed():
    cfg = load_config(overrides=["num_clients=10", "rounds=6", "clients.join.fraction=0.3", "clients.join.round=3",
                                 "clients.join.over=2"])
    a = Availability(cfg, 10)
    late = [c for c in range(10) if c not in a.available(2)]
    assert len(late) == 3 and a.available(1) == a.available(2)
    assert sorted(a.joining(3) + a.joining(4)) == late and len(a.joining(3)) == 2 and not a.joining(5)
    assert a.available(4) == list(range(10))
    assert Availability(cfg, 10).joins.tolist() == a.joins.tolist()  # a function of the seed
    # the clients of a list there in a round (what selection's check and local evaluation read)
    assert list(a.among(range(10), 2)) == a.available(2) and list(a.among(late, 3)) == a.joining(3)
    everyone = range(10)
    assert Availability(load_config(overrides=["num_clients=10"]), 10).among(everyone, 1) is everyone
    with pytest.raises(ConfigError, match="fedconcat clusters every client before round 1"):
        load_config(overrides=["algorithm=fedconcat", "clients.join.fraction=0.3", "clients.join.round=25"])
    with pytest.raises(ConfigError, match=r"must lie in \[2, rounds=6\]"):
        load_config(overrides=["rounds=6", "clients.join.fraction=0.3", "clients.join.round=6", "clients.join.over=2"])


@pytest.mark.parametrize("selection", ["random", "fedentopt"])
def test_a_newcomer_is_never_selected_before_it_joins_and_trains_after(ray_local, tmp_path, selection):
    assert main([f"selection={selection}", "num_clients=10", "participation=0.5", "rounds=6", "clients.join.fraction=0.4",
                 "clients.join.round=3", "clients.join.over=2", "partition.test_fraction=0.2",
                 f"output_dir={tmp_path}", "run_name=late", "--quiet"]) == 0
    rows = pq.read_table(tmp_path / "late" / "clients.parquet").to_pylist()
    joined = {r["cid"]: r["round"] for r in rows if r["method"] == "join"}
    assert len(joined) == 4 and sorted(set(joined.values())) == [3, 4]
    for r in rows:
        if r["cid"] in joined and r["method"] in ("client_update", "evaluate"):
            assert r["round"] >= joined[r["cid"]], r  # never trained or evaluated before it is there
    trained_late = {r["cid"] for r in rows if r["method"] == "client_update" and r["cid"] in joined}
    assert trained_late, "no newcomer was ever selected"
    m = pq.read_table(tmp_path / "late" / "metrics.parquet").to_pylist()
    assert [r["available"] for r in m] == [6, 6, 8, 10, 10, 10]
    assert all(r["clients"] == 5 for r in m)  # participation 0.5 of num_clients, drawn from those there


def test_the_algorithm_is_told_who_joins(ray_local, tmp_path):
    assert main(["plugins=[stateful_plugin]", "algorithm=test_join_recorder", "num_clients=8", "rounds=4",
                 "clients.join.fraction=0.25", "clients.join.round=3", f"output_dir={tmp_path}", "run_name=told",
                 "--quiet"]) == 0
    rows = pq.read_table(tmp_path / "told" / "clients.parquet").to_pylist()
    joined = sorted(r["cid"] for r in rows if r["method"] == "join")
    m = pq.read_table(tmp_path / "told" / "metrics.parquet").to_pylist()
    assert [r["told_joined"] for r in m] == [[], [], [3, *joined], []]


def test_fedentopt_with_newcomers_resumes_to_the_same_model(ray_local, tmp_path):
    """Newcomers upload their (noisy) label counts when they join; a resumed run gathers the same."""
    import torch

    common = ["selection=fedentopt", "fedentopt.epsilon=1", "num_clients=10", "participation=0.5", "clients.join.fraction=0.4",
              "clients.join.round=2", "clients.join.over=2", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=3", "run_name=short"]) == 0
    assert main([f"resume={tmp_path / 'short'}", "rounds=6", "--quiet"]) == 0
    assert main([*common, "rounds=6", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("short", "whole"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    sa, sb = ([r["selected"] for r in pq.read_table(tmp_path / n / "metrics.parquet").to_pylist()] for n in ("short", "whole"))
    assert sa == sb
