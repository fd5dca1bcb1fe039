"""Deterministic kernels (`determinism`, default true): what makes a CUDA run bit-identical.

Seeds fix every random draw (raysim/seeds.py), but on a GPU the same draws still give other
bits from run to run: cuDNN picks convolution algorithms by timing them (`benchmark`) and
some of them, and some cuBLAS reductions, add in an order that varies. Measured on an H200
(issue 41): two runs of the same command wrote different `model.pt` bits; with the three
settings below in every process they were identical, and client training took 17-30 %
longer. On CPU torch's kernels are deterministic already; the settings cost nothing there, but
one CPU hazard is not: see `warm_vml`.

`warn_only=True`: an op torch has no deterministic CUDA kernel for warns, naming itself, in
the actor's log instead of stopping the run mid-way (a plugin may use one): such a run's bits
are not promised.
"""
from __future__ import annotations

import os

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace (its docs' value); read when cuBLAS starts


def before_cuda() -> None:
    """In a fresh process, before its first CUDA work: cuBLAS reads its workspace setting
    once, when it starts, so it is set whatever the run asks (it costs a few MB of GPU
    memory and no time when `determinism=false`)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def apply(on: bool) -> None:
    """Deterministic kernels on (`determinism=true`) or the fastest ones (cuDNN's autotuner,
    nondeterministic algorithms allowed); can be switched between runs of one process.

    `torch.use_deterministic_algorithms` (torch 2.14) imports TorchInductor to set one flag
    of its config: 1.7-2.3 s of CPU and 149 MB in every process that calls it (each client
    actor and the server: ~3 s of a cold command's start on 2 cores, and most of its memory
    above Flower's). raysim compiles nothing, so the flag is set the way Inductor reads it
    when it is first imported (its environment variable), or on its config where a plugin
    imported it already, and torch's switch itself is set directly."""
    import torch

    warm_vml()
    _deterministic_algorithms(torch, bool(on))
    torch.backends.cudnn.deterministic = bool(on)
    torch.backends.cudnn.benchmark = not on


# The float unary ops ATen hands to MKL's VML (aten/src/ATen/cpu/vml.h, IMPLEMENT_VML_MKL)
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
           "sin", "sqrt", "tan", "tanh", "trunc")
_vml_warm = False


def warm_vml() -> None:
    """Call each VML op once, on one element, in this thread, before any multi-threaded use.
    oneMKL 2024.2 (torch's wheels up to at least 2.14) picks each VML function's kernel on its
    first call; when that first call runs on two intra-op threads at once, one thread can run
    a low-accuracy kernel for its whole chunk (pytorch/pytorch#188792, fix proposed in #188791).
    Measured here: the server's first Yogi step (`v.sqrt()` on 12,800 entries, 2 threads) gave
    the second half of the tensor ~1e-4 relative errors in 7 of 63 fresh runs (0 of 30 with
    this warm-up), so a run and its resumed twin differed (the resume test in
    tests/test_server_parts.py, which failed in CI).
    One element runs inline on the calling thread; the kernels are then settled for the process."""
    global _vml_warm
    if _vml_warm:
        return
    import torch

    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for op in VML_OPS:
            getattr(torch, op)(x)
    _vml_warm = True


def _deterministic_algorithms(torch, on: bool) -> None:
    import sys

    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is None or "torch._inductor.config" in sys.modules:  # another torch, or Inductor loaded: torch's way
        torch.use_deterministic_algorithms(on, warn_only=True)
        return
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if on else "0"  # read by Inductor's config when imported
    switch(on, warn_only=True)


def processor(device) -> str:
    """What computes a process's bits besides torch's build: the GPU's name on CUDA, else the
    CPU's model (/proc/cpuinfo's `model name`) and the vector instructions torch's kernels use
    (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY can lower): one
    config on an AMD EPYC and an Intel Xeon gives other bits (their float kernels add in other
    orders), and so do two "AMD EPYC" machines of which one has AVX512 (issue 84), so a hash
    says where it came from: "AMD EPYC (AVX512)"."""
    import platform

    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    name = (names[0] if names else platform.processor()) or platform.machine()
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return f"{name} ({capability})" if capability else name


def settings() -> dict:
    """The settings in force in this process, as tests and `device_info` report them."""
    import torch

    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
