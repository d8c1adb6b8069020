"""Worker for test_deepspeed.py: Trainer with a DeepSpeed ZeRO config (`deepspeed=`) under `torchrun`, on CPU (gloo).

Usage: ``torchrun --nproc_per_node 2 deepspeed_trainer_run.py OUT STAGE``. Runs, all in one process group:

* ``tied``: the model really tied (one parameter), no callback: the reference for the tied phase;
* ``untie``: `UntieCallback(untie_at=UNTIE_AT, untie_when=None)` (tying_mode "auto" picks the emulated mode), a
  checkpoint every SAVE_STEPS steps, then `save_model`;
* ``resume-8`` / ``resume-4``: a fresh Trainer resumed from that run's checkpoint after / before the untie;
* ``trigger``: `UntieCallback(untie_when=RULE)` with no deadline, measuring every 2 steps: the role signals of the
  tied phase (captured in autograd under DeepSpeed) feed the divergence trigger;
* ``default``: the former defaults for trained weights (`UntieCallback(metrics_every=2, from_scratch=False,
  policy="fresh-untied")`: the tied
  phase) with Trainer's tokenizer: the default trigger reads its pairs and measures, the deadline unties;
* ``fresh``: `UntieCallback()` itself on a model built fresh: the default policy trains it untied from the first step;
* ZeRO-3 only, ``nogather`` and ``nogather-resume-8`` / ``-4``: the ``untie`` run and its resumes without
  `stage3_gather_16bit_weights_on_model_save` (ZeRO-3's default), whose checkpoints hold no `model.safetensors`.

``STAGE`` 0 runs the same ``tied``, ``untie`` and ``trigger`` runs under DDP (no DeepSpeed), where the untie is live
and the probe reads the live tied gradient: the reference for the steps after the untie (the head's Adam state a copy
of the shared matrix's, as DeepSpeed's must be) and for the role signals.

The ``default`` and ``fresh`` runs' models are built by `_from_config` after their TrainingArguments, so under ZeRO-3
transformers builds them partitioned (`zero.Init`), as `from_pretrained` does for users; the other runs' models are
plain, with the DDP reference's weights. The pairs ``default`` reads must be those of the plain model: a partitioned
embedding holds no rows locally (shape [0]). Each run saves, per rank: losses and gradient norms per step; the full
fp32 matrices and Adam moments (DeepSpeed's `safe_get_full_*`) after the untie step, and the full matrices at the end.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import transformers as tf
import worker_exit
from deepspeed_cpu import fix_process_index

import untie
from untie.testing import TINY_MODELS, ToyLMDataset, tiny_tokenizer

UNTIE_AT, MAX_STEPS, SAVE_STEPS = 6, 10, 4
PAIRS = [(3, 5), (7, 40)]
#: Fires at step 4 on this data (as in fsdp2_trainer_run.py).
RULE = untie.UntieWhen(signal="cosine", threshold=2.0, smoothing=0.0, warmup=0, patience=2)


def ds_config(stage: int, gather: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": gather},
        "zero_allow_untested_optimizer": True,  # Trainer's torch AdamW, as the client optimizer
        "steps_per_print": 10**9,
    }


def build_model(partitioned: bool) -> tf.PreTrainedModel:
    """The tiny GPT-2 without dropout. `partitioned`: built as `from_pretrained` builds under a ZeRO-3 config
    (zero.Init, once TrainingArguments with that config exist); else plain, with the DDP reference's weights."""
    make_config, model_class = TINY_MODELS["gpt2"]
    config = make_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    return model_class._from_config(config) if partitioned else model_class(config)


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The full fp32 masters and Adam moments of the embedding and the head (collectives under DeepSpeed: every rank
    calls)."""
    roles = (("embedding", model.get_input_embeddings().weight), ("head", model.get_output_embeddings().weight))
    out = {}
    for name, param in roles:
        if hasattr(optimizer, "optimizer") and type(optimizer).__name__ == "DeepSpeedOptimizerWrapper":
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            out[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
            state = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
        else:
            out[name] = param.detach().cpu().clone()
            state = getattr(optimizer, "optimizer", optimizer).state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = state[key].detach().cpu().clone()
    return out


class Record(tf.TrainerCallback):
    def __init__(self) -> None:
        self.losses, self.norms, self.at_untie, self.final = [], [], {}, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            self.norms.append(logs.get("grad_norm"))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == UNTIE_AT:
            self.at_untie = full_state(model, optimizer)
        if state.global_step == MAX_STEPS:
            self.final = full_state(model, optimizer)


def train(
    out: str,
    stage: int,
    name: str,
    callback=None,
    resume: str | None = None,
    save: bool = True,
    gather: bool = True,
    tokenizer=None,
):
    args = tf.TrainingArguments(
        output_dir=os.path.join(out, f"z{stage}", name),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.3,  # bites: clipping must see the tied norm
        lr_scheduler_type="constant",
        logging_steps=1,
        save_steps=SAVE_STEPS,
        save_strategy="steps" if save else "no",
        report_to=[],
        deepspeed=ds_config(stage, gather) if stage else None,
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    model = build_model(partitioned=name in ("default", "fresh"))
    partitioned = hasattr(model.get_input_embeddings().weight, "ds_id")
    record = Record()
    callbacks = [record] + ([callback] if callback is not None else [])
    trainer = tf.Trainer(
        model=model, args=args, train_dataset=ToyLMDataset(n=64), processing_class=tokenizer, callbacks=callbacks
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    unwrapped = trainer.model
    result = {
        "losses": torch.tensor(record.losses),
        "norms": torch.tensor([n if n is not None else float("nan") for n in record.norms]),
        "at_untie": record.at_untie,
        "final": record.final,
        "tied_parameter": unwrapped.get_input_embeddings().weight is unwrapped.get_output_embeddings().weight,
        "partitioned_at_construction": partitioned,
        "warnings": [str(w.message) for w in caught if "untie" in str(w.message).lower()],
    }
    if callback is not None:
        result.update(tying_mode=callback.tying_mode, untie_step=callback.untie_step, reason=callback.untie_reason)
        result["history"] = callback.history
        result.update(pairs=callback.pairs, rule=repr(callback.rule), plan=callback.policy_choice.plan)
    return trainer, result


def main() -> None:
    worker_exit.start()
    fix_process_index()
    out, stage = sys.argv[1], int(sys.argv[2])
    results = {}
    _, results["tied"] = train(out, stage, "tied", save=False)
    trainer, results["untie"] = train(out, stage, "untie", untie.UntieCallback(untie_at=UNTIE_AT, untie_when=None))
    trigger = untie.UntieCallback(untie_at=None, untie_when=RULE, metrics_every=2, pairs=PAIRS)
    _, results["trigger"] = train(out, stage, "trigger", trigger, save=False)
    if stage == 0:  # the DDP reference
        _save(out, stage, results)
    trainer.save_model(os.path.join(out, f"z{stage}", "saved"))
    folder = os.path.join(out, f"z{stage}", "untie")
    for step in (8, 4):
        callback = untie.UntieCallback(untie_at=UNTIE_AT, untie_when=None)
        _, results[f"resume-{step}"] = train(
            out, stage, f"resume-{step}", callback, os.path.join(folder, f"checkpoint-{step}"), save=False
        )
    default = untie.UntieCallback(metrics_every=2, from_scratch=False, policy="fresh-untied")  # the former default
    _, results["default"] = train(out, stage, "default", default, save=False, tokenizer=tiny_tokenizer())
    _, results["fresh"] = train(out, stage, "fresh", untie.UntieCallback(), save=False)
    if stage == 3:  # ZeRO-3's default: checkpoints without model.safetensors, DeepSpeed's folder only
        callback = untie.UntieCallback(untie_at=UNTIE_AT, untie_when=None)
        _, results["nogather"] = train(out, stage, "nogather", callback, gather=False)
        for step in (8, 4):
            checkpoint = os.path.join(out, "z3", "nogather", f"checkpoint-{step}")
            callback = untie.UntieCallback(untie_at=UNTIE_AT, untie_when=None)
            name = f"nogather-resume-{step}"
            _, results[name] = train(out, stage, name, callback, checkpoint, save=False, gather=False)
    _save(out, stage, results)


def _save(out: str, stage: int, results: dict) -> None:
    torch.save(results, os.path.join(out, f"z{stage}-rank{torch.distributed.get_rank()}.pt"))
    worker_exit.finish()


if __name__ == "__main__":
    main()
