"""FSDP2 on CPU (2 processes, gloo): emulated tying trains exactly like real tying, then unties on every rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_ddp import _free_port

WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_emulation_run.py")
RELEASE_STEP = 7


def _torchrun(tmp_path, mode: str) -> list[dict]:
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    result = subprocess.run([*cmd, WORKER, str(tmp_path), mode], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(tmp_path / f"{mode}-rank{r}.pt") for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    return {mode: _torchrun(out, mode) for mode in ("tied", "emulated")}


def test_emulated_tying_under_fsdp2_equals_real_tying_until_the_release(runs):
    tied, emulated = runs["tied"][0], runs["emulated"][0]
    assert tied["sharded"] and emulated["sharded"] and emulated["local_rows"] < emulated["embedding"].shape[0]
    before = slice(0, RELEASE_STEP)
    # Same losses and the same pre-clipping norms: clipping sees the tied gradient once (and it bites: norms > 0.3).
    assert min(tied["norms"][before]) > 0.3
    torch.testing.assert_close(emulated["losses"][before], tied["losses"][before], rtol=0, atol=1e-6)
    torch.testing.assert_close(emulated["norms"][before], tied["norms"][before], rtol=1e-6, atol=0)
    shared = tied["at_release"]["embedding"]
    torch.testing.assert_close(emulated["at_release"]["embedding"], shared, rtol=0, atol=1e-6)
    assert torch.equal(emulated["at_release"]["head"], emulated["at_release"]["embedding"])  # mirrored shards


def test_after_the_release_the_head_trains_on_its_own_and_ranks_agree(runs):
    rank0, rank1 = runs["emulated"]
    assert not torch.equal(rank0["head"], rank0["embedding"])  # untied: the two matrices separated
    assert not torch.equal(rank0["head"], rank0["at_release"]["head"])  # and the head kept training
    assert rank0["norms"] == rank1["norms"]  # each rank's loss is its own batch's; the gradient norm is global
    assert torch.equal(rank0["head"], rank1["head"]) and torch.equal(rank0["embedding"], rank1["embedding"])
