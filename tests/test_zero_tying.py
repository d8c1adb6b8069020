"""`untie.engines.zero_tying` without DeepSpeed: the autograd tie that DeepSpeed's tied phase uses, on one process.

The DeepSpeed runs themselves (ZeRO 1-3, Trainer and Untier, 2 ranks) are in test_deepspeed.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from untie.engines.zero_tying import ZeroTying, check_optimizer
from untie.structure.surgery import untie_embeddings
from untie.testing import ToyLMDataset, tiny_model


def _loss(model) -> torch.Tensor:
    batch = ToyLMDataset(n=8)
    ids = torch.stack([batch[i]["input_ids"] for i in range(8)])
    return model(input_ids=ids, labels=ids).loss


def _twins() -> tuple:
    """A live-tied tiny GPT-2 and its twin tied in autograd (`ZeroTying`), both without dropout."""
    tied = tiny_model("gpt2")
    tied.eval()
    emulated = tiny_model("gpt2")
    emulated.eval()
    untie_embeddings(emulated)
    return tied, emulated, ZeroTying(emulated)


def test_autograd_tying_gives_each_matrix_the_tied_gradient_over_sqrt2_and_the_tied_norm():
    tied, emulated, tying = _twins()
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
    from untie.signals.probe import RoleGradientProbe

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


def _twin_runs(steps: int = 3):
    """A live-tied model and its ZeRO autograd-tied twin (no DeepSpeed: a plain AdamW), trained on one batch."""
    tied, emulated, tying = _twins()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-12) for m in (tied, emulated)]
    for _ in range(steps):
        for model, optimizer in zip((tied, emulated), optimizers, strict=True):
            _loss(model).backward()
            optimizer.step()
            optimizer.zero_grad()
    return tied, emulated, tying, optimizers


@pytest.mark.parametrize("optimizer_state", ["copy", "reset", "fresh"])
def test_release_rescales_the_moments_to_live_tyings_or_zeroes_them(optimizer_state):
    """While tied each matrix's Adam moments are live tying's scaled by 1/sqrt(2) (first) and 1/2 (second); the untie
    makes them the live untie's: `copy` both rescaled to the shared matrix's, `reset` the head's zeroed, `fresh`
    both."""
    tied, emulated, tying, (live_adam, zero_adam) = _twin_runs()
    shared = live_adam.state[tied.get_input_embeddings().weight]
    embedding, head = emulated.get_input_embeddings().weight, emulated.get_output_embeddings().weight
    for param in (embedding, head):
        state = zero_adam.state[param]
        torch.testing.assert_close(state["exp_avg"] * math.sqrt(2.0), shared["exp_avg"], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(state["exp_avg_sq"] * 2.0, shared["exp_avg_sq"], rtol=1e-4, atol=1e-12)
    tying.release(zero_adam, optimizer_state=optimizer_state)
    zeroed = {"copy": (), "reset": ("head",), "fresh": ("head", "embedding")}[optimizer_state]
    for name, param in (("embedding", embedding), ("head", head)):
        for key in ("exp_avg", "exp_avg_sq"):
            value = zero_adam.state[param][key]
            if name in zeroed:
                assert not value.any(), (name, key)
            else:
                torch.testing.assert_close(value, shared[key], rtol=1e-4, atol=1e-12, msg=f"{name} {key}")
    assert "forward" not in vars(emulated.get_input_embeddings())  # each module reads its own parameter again


def test_the_probe_reads_at_deepspeeds_step_what_it_reads_under_live_tying(monkeypatch):
    """The probe's DeepSpeed path, in one process: the tying wraps the step of DeepSpeed's optimizer (a stand-in
    whose class lives in deepspeed.runtime), and the probe reads the tied rows there from the reduced gradient (as
    ZeRO-1/2 hold it on one rank: the embedding's gradient, the tied one / sqrt(2)). Its role signals and pair
    measurements equal the live-tied probe's on the same batch."""
    from untie import _compat
    from untie.signals.metrics import role_signals_on_rows
    from untie.signals.probe import RoleGradientProbe

    monkeypatch.setattr(_compat, "deepspeed_local_grad", lambda p: None if p.grad is None else (p.grad.reshape(-1), 0))

    class DeepSpeedZeroOptimizer:  # stands for ZeRO's optimizer: its class lives in deepspeed.runtime
        __module__ = "deepspeed.runtime.zero.stage_1_and_2"

        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            self.optimizer.step()

    pairs = [(3, 5)]
    tied = tiny_model("gpt2")
    tied.eval()
    live = RoleGradientProbe(tied, pairs=pairs)
    live.armed = True
    _loss(tied).backward()
    live_grads = live.collect()
    live_signals = {**role_signals_on_rows(live_grads, pairs=pairs), **live.pair_measurements(live_grads)}

    emulated = tiny_model("gpt2")
    emulated.eval()
    untie_embeddings(emulated)
    tying = ZeroTying(emulated)
    zero = DeepSpeedZeroOptimizer(torch.optim.AdamW(emulated.parameters()))
    tying.attach_optimizer(zero)
    probe = RoleGradientProbe(emulated, pairs=pairs, emulation=tying)
    probe.armed = True
    _loss(emulated).backward()
    zero.step()  # the engine's step: the probe reads the reduced gradient here, before the step
    grads = probe.collect()
    signals = {**role_signals_on_rows(grads, pairs=pairs), **probe.pair_measurements(grads)}
    assert signals.keys() == live_signals.keys()
    for key, value in live_signals.items():
        assert math.isclose(signals[key], value, rel_tol=1e-4, abs_tol=1e-6) or (
            math.isnan(value) and math.isnan(signals[key])
        ), (key, signals[key], value)
    probe.remove()
    tying.remove()
