"""`untie.zero_tying` without DeepSpeed: the autograd tie that DeepSpeed's tied phase uses, on one process.

The DeepSpeed runs themselves (ZeRO 1-3, Trainer and Untier, 2 ranks) are in test_deepspeed.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from untie.surgery import untie_embeddings
from untie.testing import ToyLMDataset, tiny_model
from untie.zero_tying import ZeroTying, check_optimizer


def _loss(model) -> torch.Tensor:
    batch = ToyLMDataset(n=8)
    ids = torch.stack([batch[i]["input_ids"] for i in range(8)])
    return model(input_ids=ids, labels=ids).loss


def test_autograd_tying_gives_each_matrix_the_tied_gradient_over_sqrt2_and_the_tied_norm():
    tied = tiny_model("gpt2")
    tied.eval()
    emulated = tiny_model("gpt2")
    emulated.eval()
    untie_embeddings(emulated)
    tying = ZeroTying(emulated)
    loss_tied, loss_emulated = _loss(tied), _loss(emulated)
    loss_tied.backward()
    loss_emulated.backward()
    torch.testing.assert_close(loss_emulated, loss_tied, rtol=0, atol=0)
    shared = tied.get_input_embeddings().weight.grad
    embedding, head = emulated.get_input_embeddings().weight.grad, emulated.get_output_embeddings().weight.grad
    assert torch.equal(embedding, head)
    torch.testing.assert_close(embedding * math.sqrt(2.0), shared, rtol=1e-6, atol=1e-7)
    norm = torch.nn.utils.get_total_norm([p.grad for p in emulated.parameters() if p.grad is not None])
    tied_norm = torch.nn.utils.get_total_norm([p.grad for p in tied.parameters() if p.grad is not None])
    torch.testing.assert_close(norm, tied_norm, rtol=1e-6, atol=0)  # clipping sees the tied norm
    tying.release()  # no optimizer: only the forwards go back to each module's own parameter
    with torch.no_grad():
        emulated.get_output_embeddings().weight.mul_(2.0)
    assert not torch.allclose(_loss(emulated), loss_tied)  # the head now reads its own (changed) parameter


def test_autograd_tying_refuses_optimizers_whose_step_scales_with_the_gradient():
    model = tiny_model("gpt2")
    check_optimizer(torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="Adam-family optimizer.*SGD.*Use AdamW.*DDP or FSDP2"):
        check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_autograd_tying_needs_a_head_of_its_own():
    with pytest.raises(ValueError, match="really tied.*untie_embeddings"):
        ZeroTying(tiny_model("gpt2"))


@pytest.mark.parametrize("start, length", [(0, 48 * 16), (37, 300), (16 * 5, 16 * 7), (700, 68), (0, 0)])
def test_the_tied_rows_are_read_from_any_part_of_zeros_reduced_gradient(start, length, monkeypatch):
    """`read_tied_rows` at DeepSpeed's step: each rank holds one flat slice of the reduced gradient (not aligned to
    rows under ZeRO-3 or ZeRO-1/2); the rows it picks and the slice's squared norm, summed over ranks by the
    all-reduce, are the tied gradient's rows and norm. One process here: the slice is this rank's whole share."""
    from untie import _compat

    model = tiny_model("gpt2")
    untie_embeddings(model)
    tying = ZeroTying(model)
    reduced = torch.randn(48, 16)  # ZeRO holds the tied gradient / sqrt(2)
    flat = reduced.reshape(-1)
    monkeypatch.setattr(_compat, "deepspeed_local_grad", lambda param: (flat[start : start + length], start))
    ids = torch.tensor([0, 2, 5, 6, 11, 43, 47])
    rows, sq_norm = tying.read_tied_rows(ids)
    held = torch.zeros(flat.numel(), dtype=torch.bool)
    held[start : start + length] = True
    expected = torch.where(held.reshape(48, 16), reduced, torch.zeros(())) * math.sqrt(2.0)
    torch.testing.assert_close(rows, expected[ids], rtol=1e-6, atol=0)
    torch.testing.assert_close(sq_norm.item(), 2.0 * flat[start : start + length].double().square().sum().item())
    tying.remove()


def test_the_step_of_deepspeeds_optimizer_is_wrapped_while_tied_and_restored_after():
    """On a measuring step the probe reads the gradient at DeepSpeed's optimizer step, before it; `release` takes
    the wrapper off again and leaves a wrapper set on top of it by someone else in place."""
    model = tiny_model("gpt2")
    untie_embeddings(model)
    calls: list[str] = []

    class DeepSpeedZeroOptimizer:  # stands for ZeRO's optimizer: its class lives in deepspeed.runtime
        __module__ = "deepspeed.runtime.zero.stage_1_and_2"

        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            calls.append("step")

    adam = torch.optim.AdamW(model.parameters())
    zero = DeepSpeedZeroOptimizer(adam)
    wrapper = type("DeepSpeedOptimizerWrapper", (), {"optimizer": zero})()  # accelerate's
    tying = ZeroTying(model)
    tying.on_optimizer_step = lambda: calls.append("read")
    tying.attach_optimizer(wrapper)
    tying.attach_optimizer(wrapper)  # a resumed run attaches again: one wrapper
    zero.step()
    tying.capture_if = lambda: True  # a measuring step
    zero.step()
    assert calls == ["step", "read", "step"]
    tying.release()
    assert "step" not in vars(zero) and "forward" not in vars(model.get_input_embeddings())
    zero.step()
    assert calls[-1] == "step" and calls.count("read") == 1

    tying = ZeroTying(model)
    tying.attach_optimizer(wrapper)
    tying.detach_optimizer()  # the run is over while still tied: the forwards stay, the optimizer steps as before
    assert "step" not in vars(zero) and "forward" in vars(model.get_input_embeddings())
    tying.attach_optimizer(wrapper)  # another run on the same model wraps it again
    ours = zero.step
    zero.step = theirs = lambda: ours()  # someone wraps it after us
    tying.release()
    assert zero.step is theirs


def test_a_removed_probe_stops_listening_to_the_tying():
    """The probe sets three listeners on the tying; once removed (after the untie, or at close) none is left."""
    from untie.probe import RoleGradientProbe

    model = tiny_model("gpt2")
    untie_embeddings(model)
    tying = ZeroTying(model)
    probe = RoleGradientProbe(model, pairs=[(3, 5)], emulation=tying)
    probe.armed = True
    assert tying.capture_if() and tying.on_optimizer_step == probe._read_reduced_gradient
    probe.remove()
    probe.armed = True  # the removed probe's state no longer reaches the tying
    assert not tying.capture_if()
    assert tying.on_optimizer_step != probe._read_reduced_gradient
    assert tying.on_capture_lookup != probe._keep_weight_rows
    tying.remove()
