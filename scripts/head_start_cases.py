"""Run each case of issue 67 ("nothing trained is ever drawn over") on tiny offline models and print, per case, the
loss the model had before the run, the loss of the run's first step (at learning rate 0: the head the run starts
with, before any update) and the line the run said at train begin.

    python scripts/head_start_cases.py

A head drawn over trained weights shows as a first-step loss far above the loss before; a fresh model keeps its draw.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import warnings

import torch
import transformers as tf

import untie
from untie.testing import first_step_at_lr_zero, loss_on, step_llama_config, step_task, train_on_step_task


def first_step_with_trainer(model: torch.nn.Module, load=None) -> tuple[float, str]:
    """One Trainer step at lr 0 with `UntieCallback()` (`load`: called on the Trainer's model after `Trainer(...)`):
    the first step's loss and the line."""
    rows = step_task(rows=16, seed=1)
    data = [{"input_ids": row, "labels": row} for row in rows]
    with tempfile.TemporaryDirectory() as folder:
        args = tf.TrainingArguments(
            output_dir=folder, max_steps=1, per_device_train_batch_size=16, learning_rate=0.0, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        callback = untie.UntieCallback()
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.remove_callback(tf.trainer_callback.PrinterCallback)  # the losses are read from the log history
        if load is not None:
            load(trainer.model)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses[0], callback.plan or ""


def first_step_with_untier(model: torch.nn.Module) -> tuple[float, str]:
    """One custom-loop step at lr 0 with `Untier()`: the first step's loss and the line."""
    untier = untie.Untier(model, max_steps=10)
    loss = first_step_at_lr_zero(untier, model, step_task(rows=16, seed=1))
    return loss, untier.plan or ""


def main() -> None:
    logging.getLogger("untie").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    batch = step_task(rows=16, seed=1)
    cases = []

    torch.manual_seed(0)
    light = train_on_step_task(tf.LlamaForCausalLM(step_llama_config()), 12, 1e-3)
    by_hand = tf.LlamaForCausalLM(step_llama_config())
    by_hand.load_state_dict(light.state_dict())
    cases.append(("lightly trained (12 steps at 1e-3), load_state_dict, Untier()", light, by_hand, "untier", None))

    torch.manual_seed(0)
    good = train_on_step_task(tf.LlamaForCausalLM(step_llama_config()), 200, 3e-3)
    torch.manual_seed(7)
    late = tf.LlamaForCausalLM(step_llama_config())
    loader = lambda model: model.load_state_dict(good.state_dict())  # noqa: E731
    cases.append(("weights loaded after Trainer(...), UntieCallback()", good, late, "trainer", loader))

    torch.manual_seed(0)
    body = train_on_step_task(tf.LlamaForCausalLM(step_llama_config()), 60, 3e-3, freeze_embedding=True)
    frozen = tf.LlamaForCausalLM(step_llama_config())
    frozen.load_state_dict(body.state_dict())
    cases.append(("body trained against a frozen tied embedding, Untier()", body, frozen, "untier", None))

    torch.manual_seed(3)
    fresh = tf.LlamaForCausalLM(step_llama_config())
    cases.append(("a fresh model, Untier()", copy.deepcopy(fresh), fresh, "untier", None))

    for name, reference, model, adapter, load in cases:
        before = loss_on(reference, batch)
        if adapter == "trainer":
            first, line = first_step_with_trainer(model, load)
        else:
            first, line = first_step_with_untier(model)
        print(f"{name}\n  loss before {before:.3f}, at the first step {first:.3f}\n  {line}\n")


if __name__ == "__main__":
    main()
