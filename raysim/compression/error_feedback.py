"""Error feedback (Stich et al. 2018, "Sparsified SGD with Memory"; Karimireddy et al. 2019,
EF-SGD): a client compresses its update plus the residual it kept, and keeps as the new
residual what that message dropped:

    m = C(v + e),   e <- (v + e) - D(m)

so over rounds the decoded messages and the last residual add up to the updates sent: nothing
is lost, only delayed. Reference read: the authors' code of EF-SGD (epfml/error-feedback-SGD,
`ErrorFeedbackSGD`: the step plus the memory is compressed, the memory keeps the difference),
which this follows with a client's update in place of a gradient step. In FL a client's
residual waits for its next selection: measured in docs/guide.md, "Communication". The
residual is client state (it travels and is checkpointed as the platform's client state
does)."""
from __future__ import annotations

from typing import Optional

import torch

from raysim.compression.codecs import Message


def encode_with_feedback(codec, v: torch.Tensor, residual: Optional[torch.Tensor],
                         gen: Optional[torch.Generator]) -> tuple[Message, torch.Tensor]:
    """(the message of v + residual, the new residual: what the server will not apply of
    it, the codec's `applied` where it has one, else its decoding). The generator is used
    once for the encoding; the decoding here draws from a copy of its state, as the server
    will."""
    v = v.detach().reshape(-1).float().cpu()
    target = v if residual is None else v + residual
    state = gen.get_state() if gen is not None else None
    m = codec.encode(target, gen)
    if gen is not None:
        replay = torch.Generator()
        replay.set_state(state)
    else:
        replay = None
    applied = getattr(codec, "applied", codec.decode)  # what the server moves by (signsgd: lr x the signs)
    return m, target - applied(m, replay)
