"""Compiled training under the default (issue 78, item 1): the run's hooks on the model (the first batch's check of a
drawn head, an untie held for the first forward) run outside torch.compile's tracing, so a compiled model trains,
with the losses of an eager run.

The default suite compiles with backend "aot_eager": dynamo traces the model and its hooks and AOT autograd builds the
backward, as under inductor, without inductor's code generation (about 50 s for one tiny model on a 2-core CPU); the
slow test compiles with inductor, Trainer's default."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import untie
from untie.structure.policy import weights_evidence
from untie.structure.surgery import input_weight, is_tied, output_weight
from untie.testing import ToyLMDataset, loss_on, step_llama_config, step_task, tiny_model, train_on_step_task

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own graphs: dynamo does not guard module hooks, so a graph another test compiled for the
    same class could skip this test's hooks."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _untier_losses(model: torch.nn.Module, batch: torch.Tensor, backend: str | None, steps: int = 3):
    """`steps` AdamW steps on `batch` with `Untier(model, optimizer)` under the defaults, the model compiled with
    `backend` after it (None: eager): the losses, and the Untier."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    untier = untie.Untier(model, optimizer, max_steps=steps)
    forward = torch.compile(model, backend=backend) if backend is not None else model
    losses = []
    for _ in range(steps):
        loss = forward(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
        losses.append(loss.item())
    untier.close()
    return losses, untier


def test_a_model_compiled_after_untier_trains_the_default_like_eager():
    batch = step_task(rows=4, length=16, seed=1, vocab=48)
    eager, _ = _untier_losses(tiny_model("llama"), batch, None)
    model = tiny_model("llama")
    compiled, untier = _untier_losses(model, batch, "aot_eager")
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert untier.untie_step == 0 and not is_tied(model)
    assert untier.policy_choice.head_init == "model"  # the first batch judged the draw, and kept it
    assert "at the first batch, the model predicts no better with its tied head" in untier.plan


def test_under_compile_the_first_batch_still_keeps_a_trained_models_head_as_a_copy():
    """The check's copy lands before the compiled head reads its weight: the first loss is the trained model's."""
    torch.manual_seed(0)
    trained = train_on_step_task(tf.LlamaForCausalLM(step_llama_config()), 60, 3e-3, freeze_embedding=True)
    assert weights_evidence(trained).verdict == "drawn"  # read as fresh: the head is drawn at attach
    batch = step_task(rows=8, seed=1)
    before = loss_on(trained, batch)
    compiled, untier = _untier_losses(trained, batch, "aot_eager", steps=2)
    assert compiled[0] == pytest.approx(before, abs=1e-5)
    assert untier.policy_choice.head_init == "copy"


def _trainer_losses(make_args, **compile_args) -> list[float]:
    callback = untie.UntieCallback()
    args = make_args(max_steps=3, **compile_args)
    trainer = tf.Trainer(model=tiny_model("llama"), args=args, train_dataset=ToyLMDataset(), callbacks=[callback])
    trainer.train()
    assert callback.untie_step == 0 and callback.untie_reason == "start"
    assert "at the first batch" in callback.plan
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_torch_compile_trains_the_default_like_eager(make_args):
    eager = _trainer_losses(make_args)
    compiled = _trainer_losses(make_args, torch_compile=True, torch_compile_backend="aot_eager")
    assert len(compiled) == 3 and compiled == pytest.approx(eager, abs=1e-4)


@pytest.mark.slow
def test_trainer_torch_compile_with_inductor_trains_the_default_like_eager(make_args):
    eager = _trainer_losses(make_args)
    compiled = _trainer_losses(make_args, torch_compile=True)
    assert len(compiled) == 3 and compiled == pytest.approx(eager, abs=1e-4)


def test_the_untie_held_for_the_first_forward_runs_once_under_compile(tmp_path):
    """A resumed custom loop whose deadline has passed unties at its first forward (a hook); under compile that hook
    runs eagerly, once, and the compiled model trains on."""
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    untier = untie.Untier(model, optimizer, untie_at=2, untie_when=None, max_steps=4)
    batch = step_task(rows=4, length=16, seed=1, vocab=48)
    for _ in range(1):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    state, weights, moments = untier.state_dict(), model.state_dict(), optimizer.state_dict()
    untier.close()
    resumed_model = tiny_model("llama")
    resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    resumed = untie.Untier(resumed_model, untie_at=1, untie_when=None, max_steps=4)  # the deadline has passed
    resumed.start(resumed_optimizer)
    with pytest.warns(UserWarning):
        resumed.load_state_dict(state)
    resumed_model.load_state_dict(weights)
    resumed_optimizer.load_state_dict(moments)
    forward = torch.compile(resumed_model, backend="aot_eager")
    for _ in range(2):
        forward(input_ids=batch, labels=batch).loss.backward()
        resumed_optimizer.step()
        resumed_optimizer.zero_grad()
        resumed.step()
    assert resumed.untie_step == 1 and not is_tied(resumed_model)
    assert not torch.equal(output_weight(resumed_model), input_weight(resumed_model))  # the head trained on its own
