"""A test helper: every tensor of a saved model.pt by dotted name, through dicts and lists
(FedGroup and FedConcat keep a list of models, one a group or cluster), so that a test that
compares two runs' models misses none of them."""
import torch


def tensors(saved, prefix: str = "") -> dict:
    """{"global.head.weight": tensor, "groups.0.head.weight": tensor, ...} of `saved` (what
    torch.load gave for a model.pt)."""
    out = {}
    for k, v in (saved.items() if isinstance(saved, dict) else enumerate(saved)):
        if isinstance(v, (dict, list, tuple)):
            out.update(tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + str(k)] = v
    return out
