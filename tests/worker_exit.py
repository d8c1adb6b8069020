"""Start and end of the torchrun workers: Python stacks on a hard crash, and an exit that skips interpreter teardown.

A gloo process can abort in C++ ("terminate called without an active exception", SIGABRT) while the interpreter
tears down its objects after the run, even after `destroy_process_group()` (pytorch/pytorch#179291); CI saw it once
in the FSDP2 worker. The results are written by then, so the workers leave with `os._exit(0)` once every rank has
written them, and `faulthandler` prints the Python stack if a rank aborts earlier, during the run.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch.distributed as dist


def start() -> None:
    """Dump every thread's Python stack on SIGABRT / SIGSEGV, so a crash in the run says where it happened."""
    faulthandler.enable(all_threads=True)


def finish() -> None:
    """Wait for every rank, tear the process group down, flush, and exit without interpreter teardown."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
