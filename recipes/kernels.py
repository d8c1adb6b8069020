"""Portable CPU float kernels: the recipes' chaotic small runs on baseline kernel paths, the same under every path one
machine can be capped to (and yet not the same on every CPU kind: see the end).

PyTorch picks its CPU kernels by the processor's vector instructions at run time, in three places: ATen's own
kernels (`ATEN_CPU_CAPABILITY`), the BLAS (Intel MKL, whose Conditional Numerical Reproducibility mode `MKL_CBWR`
fixes its code path) and oneDNN (`ONEDNN_MAX_CPU_ISA`). On a one-layer EXor model sitting on a chance plateau, a
last-bit difference between an AVX2 and an AVX-512 reduction becomes another trajectory, so the same seed learned the
task on one CPU kind and not on another. "portable" pins all three to a code path every x86-64 CPU has: ATen's
baseline kernels, MKL's COMPATIBLE branch (strict), oneDNN's SSE4.1 kernels. With ATen and MKL pinned, lifting
oneDNN's cap alone still changed a run's loss within 3,000 steps; `scripts/kernel_paths.py` checks that the pinned
runs come out the same when the CPU offers fewer instructions.

The variables are read when each library first runs a kernel, so they are set before a run's process computes
anything: the recipes train portable runs in fresh worker processes that inherit them (`portable_environment`), and
`check_portable` refuses a run whose process picked its kernels already. They cost nothing measurable on the
recipes' tiny models; on a GPU they change nothing (CUDA's kernels are its own).

What the pins do not cover: the EXor quick preset's numbers, the same under every capped path on an AMD EPYC, came
out otherwise on an Intel Xeon (both AVX-512), each reproducibly. On the Xeon every matrix product of a probe of the
Mixer's training step ran on MKL's pinned path (MKL_VERBOSE: CNR:COMPATIBLE,STRICT; no oneDNN call), so the source
was not found. A chaotic run's numbers are therefore exact on one CPU kind (docs/recipes/exor.md, "Reproducibility").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: The environment that pins ATen, MKL and oneDNN to baseline kernel paths (not enough for every CPU kind: above).
PORTABLE_ENVIRONMENT = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE,STRICT",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
}
#: The `--kernels` choices: "portable" (the environment above) or "native" (the fastest this CPU offers).
KERNELS = ("portable", "native")


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"--kernels {kernels!r}: choose one of {KERNELS}.")


def requested_kernels(argv: list[str]) -> str:
    """The `--kernels` value of a command line (default "portable"), read before the command line is parsed: the
    environment must be set before the process computes anything. The parser checks the value later."""
    for index, arg in enumerate(argv):
        if arg == "--kernels" and index + 1 < len(argv):
            return argv[index + 1] if argv[index + 1] in KERNELS else "native"
        if arg.startswith("--kernels="):
            value = arg.split("=", 1)[1]
            return value if value in KERNELS else "native"
    return "portable"


@contextlib.contextmanager
def portable_environment(kernels: str) -> Iterator[None]:
    """Set `PORTABLE_ENVIRONMENT` in this process's environment while the block runs (processes started in it
    inherit it), then put the old values back; "native" leaves the environment as it is. A variable the user set
    already wins (e.g. `MKL_CBWR=AVX2` to try another path on purpose)."""
    check_kernels(kernels)
    if kernels == "native":
        yield
        return
    saved = {name: os.environ.get(name) for name in PORTABLE_ENVIRONMENT}
    for name, value in PORTABLE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_portable(kernels: str, *, on_cpu: bool = True) -> None:
    """Refuse a "portable" CPU run in a process whose ATen kernels are not the baseline ones (torch picked them before
    the environment was set): its numbers would be this CPU kind's, not every CPU's."""
    import torch

    if kernels != "portable" or not on_cpu:
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT" and os.environ.get("ATEN_CPU_CAPABILITY", "default").lower() == "default":
        raise RuntimeError(
            f"--kernels portable: this process already runs torch's {capability} kernels, so its numbers would be "
            "this CPU kind's. Start it with the portable environment ("
            + " ".join(f"{k}={v}" for k, v in PORTABLE_ENVIRONMENT.items())
            + "), or pass --kernels native."
        )
