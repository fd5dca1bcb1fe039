"""`resources.num_gpus_per_actor=auto`: client actors packed onto the GPUs by measured memory.

A fractional `num_gpus` is a scheduling label; it bounds no memory, so users guess how many
clients share a GPU and meet out-of-memory errors or idle devices (Flower #1383, #5855,
#3159; FL-bench #73, #83; PFLlib #130, #264). With `auto` the run starts one probe actor
holding a whole GPU and, at the round's first training call (the algorithm's own payload,
before any client of the round trains for real), runs one client update there, the largest
client of the cohort (a vectorised group: the first group), with torch's peak-memory
counters reset. An actor's footprint is then

    CUDA context (what the device held beyond torch's cache before the update: this
    process's context, and anything else on that GPU, so it errs on the safe side)
    + the peak torch reserved during the update (the training set moved to the GPU, the
      model, its optimiser and the activations of one batch)

and `actors_per_gpu` = floor(total x (1 - resources.gpu_memory_headroom) / footprint). The
probe actor goes, and actors of 1/that GPU each start on every GPU of every node (Ray places
them; the count is `placement.num_actors`', CPUs and clients bounding it too). The update the
probe made is thrown away: a client's result depends on (seed, round, client), not on where
it runs, so the real call gives the same bits. A client that does not fit a GPU alone is
one line before it trains. Where the actors see no CUDA device (Ray's GPUs are logical),
nothing is measured: one actor per GPU.
"""
from __future__ import annotations

import math
from typing import Optional

from raysim.errors import ConfigError

MiB = 2**20


def actors_per_gpu(total: int, context: int, peak: int, headroom: float) -> int:
    """How many actors of footprint `context` + `peak` bytes fit a GPU of `total` bytes with
    `headroom` of it left free; 0 when not even one does."""
    footprint = max(1, context + peak)
    return max(0, math.floor(total * (1.0 - headroom) / footprint))


def share(per_gpu: int) -> float:
    """The GPU fraction each actor reserves so that `per_gpu` of them fit one GPU (Ray keeps
    4 decimals of a fraction: rounded down)."""
    return max(1e-4, math.floor(1e4 / per_gpu) / 1e4)


def decide(probe: dict, headroom: float, what: str) -> tuple[float, dict, str]:
    """(each actor's GPU fraction, the record for summary.json, the line for log.txt) from the
    probe actor's measurement `probe` (ClientRunner.probe_memory's). `what`: the update
    measured, in words. A client that does not fit a GPU alone raises ConfigError."""
    if not str(probe.get("device", "")).startswith("cuda"):
        line = ("resources.num_gpus_per_actor=auto: the client actors see no CUDA device (Ray's GPUs are logical "
                "here), so nothing was measured: one actor per GPU")
        return 1.0, {"measured": False, "actors_per_gpu": 1, "num_gpus_per_actor": 1.0}, line
    total, context, peak = int(probe["total"]), int(probe["context"]), int(probe["peak_reserved"])
    fits = 0 if probe.get("oom") else actors_per_gpu(total, context, peak, headroom)
    record = {"measured": True, "gpu_total_bytes": total, "context_bytes": context, "peak_reserved_bytes": peak,
              "peak_allocated_bytes": int(probe.get("peak_allocated", 0)), "headroom": headroom,
              "actors_per_gpu": fits, "probe": what}
    if fits == 0:
        need = "more than the whole GPU (out of memory)" if probe.get("oom") else f"{(context + peak) / MiB:,.0f} MiB"
        raise ConfigError(f"resources.num_gpus_per_actor=auto: one client update ({what}) needs {need} of GPU memory "
                          f"with its CUDA context, and a GPU has {total / MiB:,.0f} MiB ({headroom:.0%} kept free, "
                          "resources.gpu_memory_headroom): a single client does not fit; use a smaller "
                          "local.batch_size or model, or local.vectorize_group")
    frac = share(fits)
    record["num_gpus_per_actor"] = frac
    line = (f"resources.num_gpus_per_actor=auto: one client update ({what}) peaked at {peak / MiB:,.0f} MiB of GPU "
            f"memory (torch reserved; {probe.get('peak_allocated', 0) / MiB:,.0f} MiB allocated) + {context / MiB:,.0f} MiB "
            f"CUDA context; a GPU has {total / MiB:,.0f} MiB: {fits} actors fit one with {headroom:.0%} kept free, "
            f"{frac:g} GPU each")
    return frac, record, line


def probe_clients(cids: list[int], sizes, group: Optional[int]) -> list[int]:
    """The clients the probe trains: the cohort's largest client (most samples), or, for
    vectorised groups of `group`, the cohort's first group (groups are cut in id order)."""
    cids = sorted(cids)
    if group:
        return cids[:group]
    return [max(cids, key=lambda c: (int(sizes[c]), -c))]
