"""FedBABU (Oh, Kim, Yun 2022, "FedBABU: Towards Enhanced Representation for Federated Image
Classification"): the head stays at its random initial weights throughout training (never
trained, never uploaded); clients train the encoder (the body) only and the server averages
it. A client's personal model is the global model fine-tuned on its own training data for
`fedbabu.finetune_epochs` (the whole model, as the paper's and PFLlib's default; `fedbabu.finetune=head`
fine-tunes the head alone), tested on its own test split. Compared with PFLlib's clientbabu.py
(head frozen with requires_grad=False; `fine_tune(['base', 'head'])`, 10 epochs at the
training lr) and, as issue 54's audit read it, the authors' code (jhoon-oh/FedBABU: 5 epochs
at 1/100 of the training lr: their main_fed.py, as junhyeog/FedBABU keeps it, decays the lr
tenfold at half and at three quarters of the rounds, `--ft_ep 5`; the fine-tuning script itself
is not in that copy): `fedbabu.finetune_lr=0.01` `fedbabu.finetune_epochs=5` is the authors'
setting, `fedbabu.finetune_epochs=10` PFLlib's. The default (5 epochs at the training lr, as
PFLlib's and Flower's baseline, whose MobileNet has BatchNorm) keeps the authors' epochs: at lr
0.01 a hundredth of it barely moves a head that starts at random, but at 0.1 the simple CNN
(no normalisation) fine-tuned on a #C=2 client's ~65 samples diverges on some clients (issue 72:
the results table's fedbabu_ft001 row). See algorithms/_personal.py."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.contract import Client, ClientResult
from raysim.options import Options, option
from raysim.registry import ALGORITHMS
from raysim import training
from raysim.training import local_sgd

from raysim.algorithms._personal import Personal, frozen


@dataclass
class FedBABUOptions(Options):
    finetune_epochs: int = option(5, at_least=1)  # fine-tuning for evaluation (eval.finetune_epochs > 0 wins)
    finetune: str = option("all", choices=("all", "head"))  # which part the fine-tuning trains
    finetune_lr: float = option(1.0, above=0)  # the fine-tuning's lr, as a multiple of the training lr (the authors': 0.01)


@ALGORITHMS.register("fedbabu")
class FedBABU(Personal):
    Options = FedBABUOptions
    shared = "encoder"
    unshared = "head"  # on the server: the initial head, no client's
    kept = None  # nothing of its own between rounds: the head is everyone's initial one
    client_state = False

    def train(self, client: Client, model, payload: dict) -> dict:
        with frozen(model, "head"):
            return local_sgd(client, model, self.local_loss(client, payload))

    def finetune_epochs(self, cfg) -> int:
        return int(cfg.eval.finetune_epochs) or int(cfg.fedbabu.finetune_epochs)

    def personalise(self, client: Client, payload) -> ClientResult:
        scale = float(client.cfg.fedbabu.finetune_lr)
        if client.cfg.fedbabu.finetune == "head":
            with frozen(client.model, "encoder"):
                return training.personalise(self, client, payload, scale)
        return training.personalise(self, client, payload, scale)
