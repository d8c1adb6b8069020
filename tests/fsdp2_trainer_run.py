"""Worker for test_fsdp2.py: Trainer + accelerate FSDP2 (`fsdp_config={"version": 2}`) under `torchrun`, on CPU.

accelerate selects FSDP only on accelerator devices (on CPU it trains unsharded, `MULTI_CPU`). This worker lifts that
one check, so accelerate's real FSDP2 path runs on CPU with gloo: `fsdp2_prepare_model` (`fully_shard`, DTensor
parameters), its optimizer, gradient clipping and DCP / full-state-dict checkpoints. Runs, all in one process group:

* ``tied``: the model really tied (one parameter), no callback: the reference for the tied phase;
* ``emulated``: `UntieCallback(untie_when=None, untie_at=UNTIE_AT)`
  with the default tying_mode ("auto"), sharded checkpoints, and
  drift metrics every 2 steps after the untie (read from the shards);
* ``resume-8`` / ``resume-4``: a fresh Trainer resumed from that run's checkpoint after / before the untie;
* ``full``: the same with full state-dict checkpoints, then `save_model`; ``full-resume-8`` resumes from it;
* ``trigger``: `UntieCallback(untie_when=...)` with no deadline: the role signals measured in the emulated tied
  phase feed the divergence trigger. The ``tied`` run records the same signals with a live `RoleGradientProbe`;
* ``default``: the former defaults for trained weights (`policy="fresh-untied"`, `from_scratch=False`; metrics every
  2 steps): tied, the default trigger measuring under FSDP2 too, the deadline at 30%;
* ``rates`` / ``rates-resume-8``: per-role learning rates (`embedding_lr_scale=0.5, head_lr_scale=2.0`), untied at
  UNTIE_AT, and a resume from its checkpoint after the untie;
* ``loaded`` / ``ram-efficient``: `UntieCallback()` deciding from the weights, trained ones on every rank / on rank 0
  only under accelerate's `cpu_ram_efficient_loading` (the other rank holds a fresh draw until prepare broadcasts):
  untied before the first step, the head a copy.

Each run saves, per rank: losses and gradient norms per step, the full matrices after the untie step and at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import transformers as tf
import worker_exit
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.tensor import DTensor

import untie
from untie.signals.metrics import role_signals_on_rows
from untie.signals.probe import RoleGradientProbe
from untie.testing import ToyLMDataset, tiny_model

UNTIE_AT, MAX_STEPS, SAVE_STEPS = 6, 10, 4
PAIRS = [(3, 5), (7, 40)]  # (7, 40): rows on different ranks


def _accelerate_fsdp_on_cpu() -> None:
    original = AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as accelerate does on GPUs

    AcceleratorState.__init__ = init


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class Snapshot(tf.TrainerCallback):
    """Full embedding and head after step UNTIE_AT (a collective: every rank takes it)."""

    def __init__(self) -> None:
        self.at_untie: dict[str, torch.Tensor] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == UNTIE_AT:
            self.at_untie = _matrices(model)


class LiveSignals(tf.TrainerCallback):
    """The role signals of a really tied model every 2 steps, as `UntieCallback` measures them (the reference)."""

    def __init__(self) -> None:
        self.probe, self.history = None, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.probe = RoleGradientProbe(model, pairs=PAIRS)

    def on_step_begin(self, args, state, control, **kwargs):
        self.probe.armed = (state.global_step + 1) % 2 == 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.probe.armed:
            self.probe.armed = False
            grads = self.probe.collect()
            signals = role_signals_on_rows(grads, pairs=PAIRS)
            self.history.append({"step": state.global_step + 1, **signals, **self.probe.pair_measurements(grads)})


def _trained(model: nn.Module) -> None:
    """Weights that read as trained (`untie.structure.policy.weights_evidence`): the embedding's spread 8x a draw's."""
    model.get_input_embeddings().weight.mul_(8.0)


def _trained_on_rank_0(model: nn.Module) -> None:
    """Rank 0 loaded the trained weights; every other rank holds its fresh draw (reads as drawn)."""
    if dist.get_rank() == 0:
        _trained(model)


def _matrices(model) -> dict[str, torch.Tensor]:
    return {"embedding": full(model.get_input_embeddings().weight), "head": full(model.get_output_embeddings().weight)}


def _run(
    out_dir: str,
    name: str,
    state_dict_type: str,
    callback=None,
    resume: str | None = None,
    weights: Callable[[nn.Module], None] | None = None,
    ram_efficient: bool = False,
) -> tf.Trainer:
    """One Trainer run; `weights` edits the fresh model's weights in place first (this rank's); `ram_efficient`:
    accelerate's `cpu_ram_efficient_loading`, which broadcasts rank 0's weights into the shards at prepare."""
    fsdp_config = {"version": 2, "state_dict_type": state_dict_type, "reshard_after_forward": True}
    args = tf.TrainingArguments(
        os.path.join(out_dir, name),
        fsdp=True,
        fsdp_config={**fsdp_config, **({"cpu_ram_efficient_loading": True} if ram_efficient else {})},
        use_cpu=True,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        weight_decay=0.1,
        max_grad_norm=0.3,  # clipping bites every step: the norm must be the tied gradient's
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    snapshot = Snapshot()
    callbacks = [snapshot] + ([callback] if callback is not None else [])
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    if weights is not None:
        with torch.no_grad():
            weights(model)
    trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(n=96), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    model = trainer.model
    record = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "at_untie": snapshot.at_untie,
        "final": _matrices(model),
        "sharded": isinstance(model.get_input_embeddings().weight, DTensor),
        "tied_parameter": model.get_input_embeddings().weight is model.get_output_embeddings().weight,
        "fsdp": trainer.is_fsdp_enabled,
        "ram_efficient": trainer.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading,
        "rates": [(h["step"], h["learning_rate"], h.get("untie/lr_input_embedding"), h.get("untie/lr_head"))
                  for h in trainer.state.log_history if "loss" in h],
        "role_groups": [len(g["params"]) for g in trainer.optimizer.param_groups if "untie_role" in g],
    }  # fmt: skip
    if isinstance(callback, LiveSignals):
        record["history"] = callback.history
    elif callback is not None:
        record.update(tying_mode=callback.tying_mode, untie_step=callback.untie_step, reason=callback.untie_reason)
        record["policy_reason"] = callback.policy_choice.reason
        record["history"] = callback.history
    torch.save(record, os.path.join(out_dir, f"{name}-rank{dist.get_rank()}.pt"))
    return trainer


def main(out_dir: str) -> None:
    _accelerate_fsdp_on_cpu()
    emulated = os.path.join(out_dir, "emulated")
    full_dir = os.path.join(out_dir, "full")
    _run(out_dir, "tied", "SHARDED_STATE_DICT", LiveSignals())
    measured = untie.UntieCallback(
        untie_when=None, untie_at=UNTIE_AT, metrics_every=2, pairs=PAIRS
    )  # drift after the untie
    _run(out_dir, "emulated", "SHARDED_STATE_DICT", measured)
    _run(
        out_dir,
        "resume-8",
        "SHARDED_STATE_DICT",
        untie.UntieCallback(untie_when=None, untie_at=UNTIE_AT),
        f"{emulated}/checkpoint-8",
    )
    _run(
        out_dir,
        "resume-4",
        "SHARDED_STATE_DICT",
        untie.UntieCallback(untie_when=None, untie_at=UNTIE_AT),
        f"{emulated}/checkpoint-4",
    )
    trainer = _run(out_dir, "full", "FULL_STATE_DICT", untie.UntieCallback(untie_when=None, untie_at=UNTIE_AT))
    trainer.save_model(os.path.join(out_dir, "saved"))
    _run(
        out_dir,
        "full-resume-8",
        "FULL_STATE_DICT",
        untie.UntieCallback(untie_when=None, untie_at=UNTIE_AT),
        f"{full_dir}/checkpoint-8",
    )
    rule = untie.UntieWhen(signal="cosine", threshold=2.0, smoothing=0.0, warmup=0, patience=2)  # fires at step 4
    trigger = untie.UntieCallback(untie_at=None, untie_when=rule, metrics_every=2, pairs=PAIRS)
    _run(out_dir, "trigger", "SHARDED_STATE_DICT", trigger)
    # The former defaults for trained weights (policy "fresh-untied") under FSDP2: the pair-free trigger measures at
    # step 2 (O(|T| d) per rank); the 30% deadline, step 3.
    former = untie.UntieCallback(metrics_every=2, from_scratch=False, policy="fresh-untied")
    _run(out_dir, "default", "SHARDED_STATE_DICT", former)
    # The defaults deciding from the weights: trained ones on every rank, and (accelerate's cpu_ram_efficient_loading)
    # on rank 0 only, the other rank holding a fresh draw until prepare broadcasts rank 0's into the shards.
    scales = dict(untie_when=None, untie_at=UNTIE_AT, embedding_lr_scale=0.5, head_lr_scale=2.0)
    _run(out_dir, "rates", "SHARDED_STATE_DICT", untie.UntieCallback(**scales))
    rates = os.path.join(out_dir, "rates")
    _run(out_dir, "rates-resume-8", "SHARDED_STATE_DICT", untie.UntieCallback(**scales), f"{rates}/checkpoint-8")
    _run(out_dir, "loaded", "SHARDED_STATE_DICT", untie.UntieCallback(), weights=_trained)
    _run(
        out_dir,
        "ram-efficient",
        "SHARDED_STATE_DICT",
        untie.UntieCallback(),
        weights=_trained_on_rank_0,
        ram_efficient=True,
    )


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1])
    worker_exit.finish()
