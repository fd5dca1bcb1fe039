"""A test plugin: FedAvg whose clients count, in their persistent state, how many rounds
they have taken part in, and report the count as their 'loss' (so it lands in
clients.parquet). Loaded through the `plugins` config key, as a user's plugin would be."""
from raysim.algorithms.fedavg import FedAvg
from raysim.algorithms.pfedme import PFedMe
from raysim.registry import ALGORITHMS


@ALGORITHMS.register("test_state_counter")
class StateCounter(FedAvg):
    client_state = True

    def client_update(self, client, payload):
        result = super().client_update(client, payload)
        client.state["count"] = client.state.get("count", 0) + 1
        result.metrics["loss"] = float(client.state["count"])
        return result


@ALGORITHMS.register("test_fails_in_round_3")
class FailsInRound3(FedAvg):
    """A bug in client code: round 3 raises."""

    def client_update(self, client, payload):
        if client.round == 3:
            raise ValueError("bug in round 3")
        return super().client_update(client, payload)


@ALGORITHMS.register("test_slow_state_counter")
class SlowStateCounter(StateCounter):
    """The state counter with a slow server (0.4 s per aggregation), so that a test can
    kill a run between two rounds; the numbers are StateCounter's."""

    def aggregate(self, rnd, results):
        import time

        time.sleep(0.4)
        return super().aggregate(rnd, results)


def blown_up(result):
    """`result` with NaN weights and a NaN loss, as a step too large for the model leaves it."""
    result.update = {k: v * float("nan") if v.is_floating_point() else v for k, v in result.update.items()}
    result.metrics["loss"] = float("nan")
    return result


@ALGORITHMS.register("test_nan_in_round_3")
class NaNInRound3(FedAvg):
    """Local training that blows up in round 3 (as too large a learning rate does): every
    client returns NaN weights and a NaN loss."""

    def client_update(self, client, payload):
        result = super().client_update(client, payload)
        return blown_up(result) if client.round == 3 else result


@ALGORITHMS.register("test_zero_from_round_4")
class ZeroFromRound4(FedAvg):
    """Local training that collapses from round 4 without a NaN (as FedDyn's runaway objective
    does): every client returns all-zero weights, whose model predicts one class."""

    def client_update(self, client, payload):
        result = super().client_update(client, payload)
        if client.round >= 4:
            result.update = {k: v * 0.0 if v.is_floating_point() else v for k, v in result.update.items()}
        return result


@ALGORITHMS.register("test_pfedme_nan_in_round_2")
class PFedMeNaNInRound2(PFedMe):
    """pFedMe whose clients blow up in round 2, as an unstable inner step does."""

    def client_update(self, client, payload):
        result = super().client_update(client, payload)
        return blown_up(result) if client.round == 2 else result


@ALGORITHMS.register("test_join_recorder")
class JoinRecorder(FedAvg):
    """FedAvg that records the newcomers the server announces, as a per-round metric."""

    def setup(self, server):
        super().setup(server)
        self.told: list = []

    def clients_joined(self, rnd, cids, server):
        self.told = [rnd, *cids]

    def run_round(self, rnd, server):
        extra = super().run_round(rnd, server) or {}
        told, self.told = self.told, []
        return {**extra, "told_joined": told}


def _lose_host_in_round_2(client) -> None:
    """In round 2, on a node whose processes have RAYSIM_TEST_LOSE_HOST in their
    environment: "1" kills that node's raylet (a Ray worker's parent) and exits; "all" kills
    every process of the host (a host of tests/support/hosts.py, whose PID namespace's init
    is its sshd, which lives on: Ray's autoscaler can start Ray there again)."""
    import os
    import signal

    lose = os.environ.get("RAYSIM_TEST_LOSE_HOST")
    if client.round == 2 and lose == "1":
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)
    if client.round == 2 and lose == "all" and _a_test_host():
        os.kill(-1, signal.SIGKILL)  # every process of the host but its init (sshd) and this one
        os._exit(1)


@ALGORITHMS.register("test_loses_its_host")
class LosesItsHost(FedAvg):
    """FedAvg whose clients lose their host in round 2 (`_lose_host_in_round_2`). Elsewhere,
    and in the call made again, it is FedAvg."""

    def client_update(self, client, payload):
        _lose_host_in_round_2(client)
        return super().client_update(client, payload)


@ALGORITHMS.register("test_loses_its_host_counting")
class LosesItsHostCounting(StateCounter):
    """The state counter (client state: rounds taken part in, and 256 KB more, so that Ray
    would keep it in the writing node's object store rather than inline in its owner),
    losing its host in round 2: the states written in round 1 on that host must outlive it."""

    def client_update(self, client, payload):
        import torch

        _lose_host_in_round_2(client)
        result = super().client_update(client, payload)
        client.state["ballast"] = torch.full((65536,), float(client.state["count"]))
        return result


def _a_test_host() -> bool:
    """Whether this process runs on a host of tests/support/hosts.py (its own PID namespace,
    whose init is that host's sshd), where killing every process kills only that host."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            init = f.read()
    except OSError:
        return False
    return b"sshd" in init and b"rshosts-" in init


from raysim.algorithms.uniform import UniformSelection  # noqa: E402
from raysim.registry import SELECTIONS  # noqa: E402


@SELECTIONS.register("test_uniform_listed")
class UniformListed(UniformSelection):
    """Uniform selection that does not declare `uniform_draw`: asynchronous runs list the free
    clients for it on every arrival (runtime/asynchronous.py's general path), where `random` draws from
    `FreeClients`; the picks must be the same."""

    uniform_draw = False
