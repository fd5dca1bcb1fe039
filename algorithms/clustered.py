"""Clustered FL: m group models instead of one global model (FedGroup, IFCA, FeSEM).

What the three share, built on FedAvg's client half:

- `GroupModels`: the server keeps m group models, each client's group (`group_of`, -1 until
  the client is placed), and the "auxiliary" global model = the plain mean of the group
  models (FedGroup's line 11; FlexCFL's `update_auxiliary_global_model`). One round of
  group training (`train_groups`): every group runs FedAvg over its members of the cohort,
  all groups' tasks out before any result is read; a group with no member in the cohort
  keeps its model. Per round it records the group sizes, how many clients are placed and
  the discrepancy (mean ||w_i - w_group|| over the round's clients, after aggregation).
  Evaluation: the auxiliary model on the global test set ("accuracy") and each group model
  (`group<g>_accuracy`); on the clients' local test splits (`partition.test_fraction > 0`)
  each client is served by its group's model, a client not placed yet by the auxiliary
  model (the model a newcomer would get), so every client there is evaluated every round.
  The group of every client is server state: in `state_dict`, so checkpoints keep it.
- `ClientPicksGroup`: IFCA and FeSEM, where the client chooses: every selected client
  receives all m models, picks one by the subclass's rule (`pick`), trains it and reports
  which; the server averages each model over the clients that picked it.

Reference: morningD/FlexCFL (flearn/trainer/groupbase.py, group.py), FedGroup's authors'
code, which the FedGroup paper's experiments (IFCA and FeSEM included) come from.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from raysim.contract import Client, ClientResult, Server
from raysim.algorithms.fedavg import FedAvg
from raysim.errors import ConfigError
from raysim.options import Options, option
from raysim.training import WeightedMean, cpu_state, parameter_names, seed_for


@dataclass
class GroupsOptions(Options):
    groups: int = option(3, at_least=1)  # m: the number of group models

    def check(self, cfg, section: str) -> None:
        if self.groups > cfg.num_clients:
            raise ConfigError(f"{section}.groups must be in [1, num_clients={cfg.num_clients}], got {self.groups}")


def flat(state: dict, names) -> torch.Tensor:
    """The named entries of a state dict as one float64 vector (a model's "flattened update")."""
    return torch.cat([state[n].detach().reshape(-1).double() for n in names])


class GroupModels(FedAvg):
    """m group models, each trained by FedAvg over its members (module docstring)."""
    trains_privately = False  # privacy.mode=local refused: a client picks its group by its loss on its data, outside DP-SGD

    server_parts = ()
    returns_model = False  # a client may return its pick of m models (IFCA, FeSEM)
    own_server_rule = "it keeps a model per group, each the mean of its members"

    Options = GroupsOptions

    @property
    def opts(self):
        return self.cfg[type(self).config_section or self.cfg.algorithm]

    # ------------------------------------------------------------------ server
    def setup(self, server: Server) -> None:
        self.num_clients = server.num_clients
        self.group_of = np.full(server.num_clients, -1, dtype=np.int64)
        self.w0 = server.new_model()
        self.names = sorted(parameter_names(self.w0))  # trainable parameters: what "a model" is in distances
        self.models = self.initial_models(server)
        self.aux = copy.deepcopy(self.w0)
        self.refresh_aux()

    def initial_models(self, server: Server) -> list[torch.nn.Module]:
        """The m group models before round 1. Default: m independent random initialisations
        (IFCA and FeSEM; FlexCFL seeds group g with (g + seed) * 888); FedGroup clusters."""
        models = []
        for g in range(int(self.opts.groups)):
            torch.manual_seed(seed_for(int(self.cfg.seed), 888, g))
            models.append(self.build_model(self.input_shape))
        return models

    def refresh_aux(self) -> None:
        """The auxiliary global model: the plain (unweighted) mean of the group models."""
        mean = WeightedMean()
        for m in self.models:
            mean.add(m.state_dict(), 1.0)
        self.aux.load_state_dict(mean.result(self.aux.state_dict()))

    def train_groups(self, rnd: int, server: Server, cohort: list[int]) -> dict:
        """FedAvg inside every group over its members of `cohort` (all placed)."""
        calls = []
        for g, model in enumerate(self.models):
            members = [c for c in cohort if self.group_of[c] == g]
            if members:
                calls.append((g, server.run_clients(rnd, members, {"weights": cpu_state(model)})))
        folded, loss = self.fold(calls)
        self.mix_groups(sorted(folded))
        return self.after_round(folded, loss)

    def mix_groups(self, trained: list[int]) -> None:
        """After the groups' FedAvg, before the metrics: FedGroup's inter-group aggregation."""

    def fold(self, calls: list[tuple[int, Iterator[ClientResult]]]) -> tuple[dict[int, list], float]:
        """Average each group's results into its model (sample-weighted). Returns each trained
        group's clients' flattened models (for the discrepancy) and the mean training loss."""
        folded: dict[int, list] = {}
        loss, n = 0.0, 0.0
        for g, results in calls:
            mean, models = WeightedMean(), []
            for r in results:
                mean.add(r.update, r.num_samples)
                models.append(flat(r.update, self.names))
                loss += r.metrics["loss"] * r.num_samples
            new = mean.result(self.models[g].state_dict())
            if new is not None:  # every member dropped out: the group keeps its model
                self.models[g].load_state_dict(new)
                n += mean.total
                folded[g] = models
        return folded, (loss / n if n else float("nan"))

    def after_round(self, folded: dict[int, list], loss: float) -> dict:
        """The round's metrics; then the auxiliary model follows the groups."""
        gaps = []
        for g, models in folded.items():
            group = flat(self.models[g].state_dict(), self.names)  # once per group, not per client
            gaps += [float(torch.linalg.vector_norm(w - group)) for w in models]
        self.refresh_aux()
        placed = self.group_of[self.group_of >= 0]
        out = {"groups_trained": len(folded), "placed": len(placed),
               "group_sizes": np.bincount(placed, minlength=len(self.models)).tolist()}
        if folded:
            out.update(discrepancy=float(np.mean(gaps)), train_loss=loss)
        return out

    def eval_models(self) -> dict:
        return {"global": self.aux, **{f"group{g}": m for g, m in enumerate(self.models)}}

    def serving(self, cids: list[int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for c in cids:
            g = int(self.group_of[c])
            out.setdefault(f"group{g}" if g >= 0 else "global", []).append(c)
        return out

    def state_dict(self) -> dict:
        return {"groups": [m.state_dict() for m in self.models], "group_of": torch.as_tensor(self.group_of)}

    def load_state_dict(self, state: dict) -> None:
        for m, s in zip(self.models, state["groups"]):
            m.load_state_dict(s)
        self.group_of = state["group_of"].numpy().copy()
        self.refresh_aux()


class ClientPicksGroup(GroupModels):
    """IFCA and FeSEM: the selected clients receive all m models and each picks one (`pick`)."""

    def run_round(self, rnd: int, server: Server) -> dict:
        cohort = server.select_clients(rnd)
        payload = {"models": [cpu_state(m) for m in self.models], **self.extra_payload(cohort)}
        picked: dict[int, list] = {}  # the round's results by the model picked: O(cohort) models held
        for r in server.run_clients(rnd, cohort, payload):
            g = int(r.metrics["group"])
            self.group_of[r.cid] = g
            picked.setdefault(g, []).append(r)
        folded, loss = self.fold([(g, iter(rs)) for g, rs in sorted(picked.items())])
        return self.after_round(folded, loss)

    def extra_payload(self, cohort: list[int]) -> dict:
        return {}

    # ---- client ----
    def pick(self, client: Client, models: list[dict], payload: dict) -> int:
        raise NotImplementedError

    def client_update(self, client: Client, payload: Any) -> ClientResult:
        g = self.pick(client, payload["models"], payload)
        result = super().client_update(client, {"weights": payload["models"][g]})
        result.metrics["group"] = g
        return result
