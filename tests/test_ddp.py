"""DDP on CPU (2 processes, gloo): both ranks untie at the same step and hold identical weights afterwards."""

from __future__ import annotations

import math
import os

import pytest
import torch
from launch import torchrun

pytestmark = pytest.mark.distributed  # every test here launches processes (pytest -m 'not distributed')

WORKER = os.path.join(os.path.dirname(__file__), "ddp_untie_run.py")


def _torchrun(tmp_path, arch: str, mode: str) -> list[dict]:
    torchrun(WORKER, tmp_path, arch, mode)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_ranks_untie_together_and_stay_identical(arch, tmp_path):
    rank0, rank1 = _torchrun(tmp_path, arch, "sync")
    assert rank0["distributed_type"] == "MULTI_CPU"
    assert rank0["untie_step"] == rank1["untie_step"] == 4
    assert not rank0["tied"] and not rank1["tied"]
    assert not torch.equal(rank0["output"], rank0["input"])  # the head trained on its own
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


def test_emulated_tying_under_ddp_equals_a_live_untie_and_ranks_agree(tmp_path):
    """DDP reduces the emulated head's gradient itself (it exists at wrap time); the fold comes after that reduction."""
    live = _torchrun(tmp_path / "live", "gpt2", "sync")
    rank0, rank1 = _torchrun(tmp_path / "emulated", "gpt2", "emulated")
    assert (rank0["tying_mode"], live[0]["tying_mode"]) == ("emulated", "live")
    assert rank0["untie_step"] == rank1["untie_step"] == 4
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
        torch.testing.assert_close(value, live[0]["params"][name], rtol=0, atol=1e-5)


def test_without_gradient_sync_the_untied_head_diverges(tmp_path):
    """Negative control for the test above: DDP alone does not reduce a parameter created after wrapping."""
    rank0, rank1 = _torchrun(tmp_path, "gpt2", "nosync")
    # Everything drifts: gradient clipping sees each rank's local head gradient, so even DDP-averaged params differ.
    assert not torch.equal(rank0["output"], rank1["output"])


def test_divergence_trigger_decides_on_every_rank_from_the_same_signals(tmp_path):
    """Each rank sees its own batches, but the role gradients are averaged over ranks before the signals."""
    rank0, rank1 = _torchrun(tmp_path, "gpt2", "trigger")
    assert rank0["untie_step"] == rank1["untie_step"] == 6
    assert rank0["untie_reason"] == rank1["untie_reason"] == "trigger"
    assert len(rank0["history"]) == 5
    assert rank0["history"] == rank1["history"]  # identical signals, measured from the all-reduced role gradients
    tied_phase = [h for h in rank0["history"] if "cosine" in h]
    assert len(tied_phase) == 3 and all(math.isfinite(h["gap/3-4"]) for h in tied_phase)  # summed over both ranks
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name

    # The union of the ranks' rows, averaged, is what one process measures on both ranks' batches at once.
    torchrun(WORKER, tmp_path / "single", "gpt2", "trigger-single", processes=1)
    single = torch.load(tmp_path / "single" / "rank0.pt")
    assert [h["step"] for h in single["history"]] == [h["step"] for h in rank0["history"]]
    for mine, reference in zip(tied_phase, single["history"][:3], strict=True):
        for key in ("cosine", "cancellation", "norm_ratio", "conflict", "agreement", "tension/3-4", "gap/3-4"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key


def test_ranks_that_read_their_weights_differently_take_rank_0s_plan(tmp_path):
    """The default decides from the weights (`untie.structure.policy.weights_evidence`); ranks whose weights differ
    before DDP broadcasts rank 0's (here rank 1's embedding scaled 8x, which reads as trained) still take one plan:
    rank 0's (built fresh: untied from step 0), and end identical. Without the broadcast rank 1 would stay tied and
    DDP would refuse models of different structure."""
    rank0, rank1 = _torchrun(tmp_path, "gpt2", "disagree")
    assert rank0["untie_step"] == rank1["untie_step"] == 0
    assert rank0["untie_reason"] == rank1["untie_reason"] == "start"
    assert not rank0["tied"] and not rank1["tied"]
    assert "rank 0 reads its weights as drawn" in rank1["policy_reason"]
    assert "rank 0" not in rank0["policy_reason"]
    # the drawn head's first-batch check ran inside DDP's first forward on both ranks (one broadcast, rank 0's verdict)
    assert "at the first batch" in rank0["policy_reason"] and "at the first batch" in rank1["policy_reason"]
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


def test_a_loaded_model_given_a_ddp_optimizer_first_unties_at_start_and_ranks_agree(tmp_path):
    """`Untier(ddp_model, optimizer)` on a trained tied model: the default's untie at step 0 happens at the start of
    training (the wrapper and the optimizer exist), the copied head joins the optimizer, and the ranks stay equal."""
    torchrun(os.path.join(os.path.dirname(__file__), "ddp_built_optimizer_run.py"), tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for run in (rank0, rank1):
        assert run["untie"] == (0, "start") and run["head_init"] == "copy" and run["in_optimizer"]
    params = rank0["params"]
    assert not torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])  # trained apart
    for name, value in params.items():
        assert torch.equal(value, rank1["params"][name]), name


def test_per_role_rates_under_trainer_ddp_the_head_made_after_wrapping_joins_its_group_and_ranks_agree(tmp_path):
    rank0, rank1 = _torchrun(tmp_path, "gpt2", "rates")
    assert rank0["untie_step"] == rank1["untie_step"] == 4
    assert rank0["role_groups"]["input_embedding"] == rank0["role_groups"]["head"] == 1
    for step, lr, embedding, head in rank0["rates"]:
        assert (embedding, head) == ((lr, lr) if step <= 4 else (0.5 * lr, 2.0 * lr)), step
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
