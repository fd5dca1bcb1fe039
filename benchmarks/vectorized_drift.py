"""How far a vectorised run (`local.vectorize`) lands from the sequential run of the same
config, under every float arithmetic this processor offers (issue 86).

    python benchmarks/vectorized_drift.py                  # about 5 minutes on 2 cores
    python benchmarks/vectorized_drift.py --models mlp --algorithms fedavg --rounds 30

The run is tests/test_vectorized.py's (digits, 30 clients, half a round, 3 rounds x 2
epochs, batch 16, groups of 4), made in this process twice per setting: vectorised and
sequential. Each setting is a child process with other kernels for the same arithmetic:
torch's own vector kernels (`ATEN_CPU_CAPABILITY`: default, avx2, avx512 where the processor
has it) x MKL's matmul code path (`MKL_CBWR` unset, AUTO, and the instruction sets below it). Each
is what another processor would compute: the issue's Intel Xeon runs AVX512 kernels, an AMD
EPYC AVX2 ones, and both paths' rounding moves with them.

Printed per setting and (model, algorithm): the largest |vectorised - sequential| over the
model's entries, and that over the test's tolerance (atol + rtol |sequential|; > 1 fails).
The summary gives, per (model, algorithm), the spread over settings. A model with ReLU
(`mlp`) has two outcomes: rounding-level (~1e-8), or one hidden unit whose input sits within
a rounding error of 0 in some step (one sample, one unit: its input computed as -1.5e-8 by
one path and +1.5e-8 by the other) switches sides, and the two runs then differ by that
unit's one gradient (~5e-4 at lr 0.05). `mclr` (no ReLU) has only the first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = ["num_clients=30", "participation=0.5", "local.epochs=2", "local.batch_size=16", "eval_every=1",
       "checkpoint_every=0", "--quiet"]
VECTORISED = ["local.vectorize=true", "local.vectorize_group=4"]
EXTRA = {"fedgroup": ["fedgroup.groups=2"]}
TOLERANCE = (1e-4, 1e-3)  # tests/test_vectorized.py's (atol, rtol) before issue 86


def floats(saved) -> dict:
    """Every floating tensor of a model.pt by dotted name (tests/support/saved_models.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
    from saved_models import tensors

    return {k: v for k, v in tensors(saved).items() if v.is_floating_point()}


def child(models: list[str], algorithms: list[str], rounds: int) -> None:
    """One setting: every (model, algorithm) vectorised and sequential, one JSON line each."""
    import torch

    from raysim.run import main

    out = Path(tempfile.mkdtemp())
    for model in models:
        for algorithm in algorithms:
            args = [f"model={model}", f"algorithm={algorithm}", *EXTRA.get(algorithm, []), *RUN, f"rounds={rounds}",
                    f"output_dir={out}"]
            tag = f"{model}-{algorithm}"
            assert main([*args, *VECTORISED, f"run_name={tag}-v"]) == 0
            assert main([*args, f"run_name={tag}-s"]) == 0
            v = floats(torch.load(out / f"{tag}-v" / "model.pt", weights_only=True))
            s = floats(torch.load(out / f"{tag}-s" / "model.pt", weights_only=True))
            atol, rtol = TOLERANCE
            print(json.dumps({"model": model, "algorithm": algorithm,
                              "max_abs": max((v[k] - s[k]).abs().max().item() for k in v),
                              "over_tolerance": max(((v[k] - s[k]).abs() / (atol + rtol * s[k].abs())).max().item()
                                                    for k in v),
                              "relative": max(((v[k] - s[k]).norm() / s[k].norm().clamp_min(1e-12)).item() for k in v),
                              "capability": torch.backends.cpu.get_cpu_capability()}), flush=True)


def settings() -> list[dict]:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    caps = ["default", "avx2"] + (["avx512"] if " avx512f " in flags else [])
    # "unset": MKL's own dispatch, what a user runs (on this EPYC it computes otherwise than AUTO)
    mkl = ["unset", "AUTO", "COMPATIBLE", "SSE4_2", "AVX"] + (["AVX2"] if " avx2 " in flags else []) \
        + (["AVX512"] if " avx512f " in flags else [])
    return [{"ATEN_CPU_CAPABILITY": c, "MKL_CBWR": m} for c in caps for m in mkl]


def processor() -> str:
    import platform

    for line in open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mclr,mlp")
    p.add_argument("--algorithms", default="fedavg,scaffold,fedgroup")
    p.add_argument("--rounds", type=int, default=3, help="the test's 3; more shows how the paths part over a run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    models, algorithms = a.models.split(","), a.algorithms.split(",")
    if a.child:
        child(models, algorithms, a.rounds)
        return
    import torch

    print(f"processor: {processor()}; torch {torch.__version__}, default capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {a.rounds} rounds; tolerance atol {TOLERANCE[0]}, rtol {TOLERANCE[1]}")
    seen: dict = {}
    for env in settings():
        given = {k: v for k, v in {**os.environ, **env}.items() if v != "unset"}
        r = subprocess.run([sys.executable, __file__, "--child", "--models", a.models, "--algorithms", a.algorithms,
                            "--rounds", str(a.rounds)],
                           capture_output=True, text=True, env=given, cwd=Path(__file__).parent.parent)
        rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        if r.returncode != 0 or not rows:
            print(f"{env}: failed\n{r.stderr[-1500:]}")
            continue
        for row in rows:
            seen.setdefault((row["model"], row["algorithm"]), []).append(row)
            print(f"ATEN_CPU_CAPABILITY={env['ATEN_CPU_CAPABILITY']:<8} MKL_CBWR={env['MKL_CBWR']:<10} "
                  f"{row['model']:<5} {row['algorithm']:<9} max |vec - seq| {row['max_abs']:.3g}  "
                  f"/ tolerance {row['over_tolerance']:.3g}  relative {row['relative']:.3g}", flush=True)
    print("\nsummary over settings: max |vec - seq| (min, median, max); relative (max)")
    for (model, algorithm), rows in seen.items():
        values = sorted(r["max_abs"] for r in rows)
        fails = sum(r["over_tolerance"] > 1 for r in rows)
        print(f"  {model:<5} {algorithm:<9} {values[0]:.3g}  {values[len(values) // 2]:.3g}  {values[-1]:.3g}; "
              f"{max(r['relative'] for r in rows):.3g}; over the old tolerance in {fails} of {len(rows)} settings")


if __name__ == "__main__":
    main()
