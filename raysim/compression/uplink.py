"""`compress.up`: the update a client sends, encoded where it trained and decoded by the
server before anything reads it (issue 57).

A client of a FedAvg-family algorithm (`Algorithm.compressible()`: its `client_update`
returns its whole model for the payload's `weights`; FedBuff and FedAsync included) trains
as always; then the runtime takes its update, the difference between its trainable parameters and the weights it received, as one
flat float32 vector (the parameters in sorted-name order), and sends the codec's message of
it instead (`Compressed`). Non-trainable entries (BatchNorm statistics, counters) travel as
they are and are counted as such. The server decodes the vector, adds it to the weights it
sent and hands the algorithm the client's model as if it had come whole: aggregators,
server optimisers, central DP and the clients table see decoded models and need not know.

- Randomness (random-k's indices, QSGD's rounding) comes from a generator seeded from (seed,
  round, client, `STREAM`); the server seeds its own alike to decode random-k: a message
  depends on nothing but the run's seed, wherever it was encoded.
- Error feedback (`compress.error_feedback`): the client encodes its update plus its
  residual and keeps as its new residual what the message dropped (error_feedback.py). The
  residual is client state the runtime keeps for the algorithm (`RESIDUAL`, sent with the
  call and checkpointed as any client state), out of the algorithm's sight.
- The bytes: `Compressed.nbytes` is its message's length plus the raw entries; each
  codec here has a fixed-width message for a vector of n entries, so `message_bytes` (a real
  encoding of n zeros) is every client's upload size, which the clock reads before training.
- `signsgd` sends bare signs (decoded as +1 / -1) for `server.aggregator=majority_vote`
  (Bernstein et al. 2018): the server steps by `server.lr` times the sign of the vote; its
  error feedback keeps what `server.lr` times the signs left (`BareSign.applied`).
  `compress.up=sign` with majority vote and error feedback is refused (config/validate.py):
  its residual would subtract the scaled signs, which the vote does not apply.

Order on a client: training (and `privacy.mode=local`'s DP-SGD) -> a model attack
(raysim/attacks.py) -> compression. On the server: decoding -> clipping and noise of
`privacy.mode=central` (on decoded updates: the clipping bounds what each client adds, so the
guarantee holds whatever the codec) -> the aggregator and server optimiser.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from raysim.compression.codecs import QSGD, Message, RandK, ScaledSign, TopK
from raysim.compression.error_feedback import encode_with_feedback
from raysim.seeds import seed_for

CODECS = ("none", "topk", "randk", "qsgd", "sign", "signsgd")
RESIDUAL = "compress.residual"  # the key of a client's error-feedback residual in its state
STREAM = 57  # seed_for(seed, round, client, STREAM): the codec's randomness


class BareSign(ScaledSign):
    """signSGD's message: the signs alone (no scale travels); decoded as +1 / -1. What the
    server applies of it is `step` (`server.lr`) times the signs (majority vote with one
    voter), so error feedback keeps (v + e) - step x sign(v + e), as epfml/error-feedback-SGD
    scales the sign by the learning rate in both the step and the memory: a residual of
    (v + e) - sign(v + e) would be of order 1 against updates of order lr and flip every
    sign it touched."""

    name = "signsgd"

    def __init__(self, step: float = 1.0):
        super().__init__()
        self.step = float(step)

    def applied(self, m: Message, gen=None) -> torch.Tensor:
        """What the server moves by for this message: `step` times its signs."""
        return self.signs(m) * self.step

    def encode(self, v, gen=None) -> Message:
        m = super().encode(v, gen)
        del m.parts["scale"]
        return Message(self.name, m.n, m.parts)

    def decode(self, m: Message, gen=None) -> torch.Tensor:
        return self.signs(m)


def codec_of(cfg, blocks: Optional[list] = None):
    """The codec `compress.*` names (`blocks`: the update's tensors' lengths, in its order, for
    `compress.sign_scale=tensor`)."""
    c = cfg.compress
    per_tensor = blocks if c.get("sign_scale", "update") == "tensor" else None
    return {"topk": lambda: TopK(c.ratio), "randk": lambda: RandK(c.ratio),
            "qsgd": lambda: QSGD(int(c.bits), int(c.bucket)), "sign": lambda: ScaledSign(per_tensor),
            "signsgd": lambda: BareSign(float(cfg.server.lr))}[c.up]()


@dataclass
class Compressed:
    """What a compressing client sends in place of its model: the message of its trainable
    parameters' update and the other entries as they are."""
    message: Message
    rest: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        from raysim.training import nbytes

        return self.message.nbytes + nbytes(self.rest)


class Uplink:
    """Both ends of `compress.up` for one run: `send` on the client, `receive` on the server."""

    def __init__(self, cfg, trainable: list[str], sizes: Optional[dict] = None):
        self.keys = sorted(trainable)
        self.codec = codec_of(cfg, [sizes[k] for k in self.keys] if sizes else None)
        self.feedback = bool(cfg.compress.error_feedback)
        self.seed = int(cfg.seed)
        self._message_bytes: dict[int, int] = {}  # entries encoded -> the message's bytes (fixed-length codecs)

    @classmethod
    def from_config(cls, cfg, model: torch.nn.Module) -> Optional["Uplink"]:
        """None when `compress.up=none`."""
        if cfg.get("compress") is None or cfg.compress.up == "none":
            return None
        from raysim.training import parameter_names

        state = model.state_dict()
        names = list(parameter_names(model))
        return cls(cfg, names, {k: state[k].numel() for k in names if k in state})

    @staticmethod
    def applies(method: str, on: str) -> bool:
        """Training calls of the algorithm: what a client uploads as its update."""
        return method == "client_update" and on == "algorithm"

    def keeps_state(self, method: str, on: str) -> bool:
        """Whether these calls carry client state for the residual (error feedback's)."""
        return self.feedback and self.applies(method, on)

    def _generator(self, rnd: int, cid: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed_for(self.seed, rnd, cid, STREAM))

    def _compressed_keys(self, weights: dict) -> list[str]:
        return [k for k in self.keys if k in weights and weights[k].is_floating_point()]

    def hide(self, client) -> Optional[torch.Tensor]:
        """Take the residual out of `client.state` before the algorithm sees it (`send` puts
        the new one back)."""
        return client.state.pop(RESIDUAL, None)

    def send(self, client, payload, result, rnd: int, residual: Optional[torch.Tensor] = None, plugin=None):
        """The client's result with its update encoded; with error feedback, `residual` (what
        `hide` took) goes into the message and the new residual into `client.state`. A
        `plugin` with an `uploaded` hook (contract.Algorithm.uploaded) is then told what the
        server will decode."""
        sent, trained = payload["weights"], result.update
        keys = self._compressed_keys(trained)
        v = torch.cat([(trained[k].detach().float().cpu() - sent[k].float().cpu()).reshape(-1) for k in keys])
        gen = self._generator(rnd, client.cid)
        if self.feedback:
            message, client.state[RESIDUAL] = encode_with_feedback(self.codec, v, residual, gen)
        else:
            message = self.codec.encode(v, gen)
        result.update = Compressed(message, {k: t for k, t in trained.items() if k not in keys})
        if plugin is not None and plugin.uploaded is not None:
            plugin.uploaded(client, payload, trained, self.receive(result.update, payload, rnd, client.cid))
        return result

    def receive(self, update, payload, rnd: int, cid: int) -> dict:
        """The client's model: the weights sent plus the decoded update (`update` as it came
        when it is not `Compressed`: a client that sent no update)."""
        if not isinstance(update, Compressed):
            return update
        sent = payload["weights"]
        keys = self._compressed_keys(sent)
        delta = self.codec.decode(update.message, self._generator(rnd, cid))
        out, start = {}, 0
        for k in keys:
            n = sent[k].numel()
            out[k] = (sent[k].float() + delta[start:start + n].reshape(sent[k].shape)).to(sent[k].dtype)
            start += n
        return {k: out[k] if k in out else update.rest[k] for k in sent if k in out or k in update.rest}

    def message_bytes(self, weights: dict) -> int:
        """The bytes a client sends for `weights`: a real encoding of a zero update (every
        codec here sends the same length for the same number of entries) and the other
        entries' raw bytes."""
        from raysim.training import nbytes

        keys = self._compressed_keys(weights)
        n = sum(weights[k].numel() for k in keys)
        if n not in self._message_bytes:  # encoded once: the clock asks every round
            self._message_bytes[n] = self.codec.encode(torch.zeros(n), torch.Generator().manual_seed(0)).nbytes
        return self._message_bytes[n] + nbytes({k: t for k, t in weights.items() if k not in keys})


