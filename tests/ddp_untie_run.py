"""Worker for test_ddp.py: run under `torchrun --nproc_per_node 2`; each rank dumps its final parameters."""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers as tf
import worker_exit
from conftest import training_args  # the script's folder (tests/) is on sys.path

import untie
import untie.core.run
from untie.testing import ToyLMDataset, tiny_model


def main(out_dir: str, arch: str, mode: str) -> None:
    tf.logging.set_verbosity_error()
    if mode == "nosync":  # negative control: show that without the hook the ranks drift apart
        untie.core.model_structure.sync_grads_across_ranks = lambda param: None
    model = tiny_model(arch)
    # "trigger-single": one process with both ranks' batches (8 = 2 x 4, the same samples in the same steps).
    batch_size = 8 if mode == "trigger-single" else 4
    args = training_args(
        out_dir, max_steps=10, per_device_train_batch_size=batch_size, gradient_accumulation_steps=2, ddp_backend="gloo"
    )
    if mode.startswith("trigger"):
        # No dropout: the averaged role gradients of 2 ranks then equal one process's on the joint batch.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        mode = "trigger"
    if mode == "trigger":  # the divergence trigger, fed by role signals measured every 2 steps, fires at step 6
        rule = untie.UntieWhen(signal="cosine", threshold=2.0, smoothing=0.5, warmup=0, patience=3)
        callback = untie.UntieCallback(untie_at=None, untie_when=rule, metrics_every=2, pairs=[(3, 4)])
    elif mode == "disagree":  # the defaults, on ranks that read their weights differently: rank 1's look trained
        if int(os.environ["RANK"]) == 1:
            with torch.no_grad():
                model.get_input_embeddings().weight.mul_(8.0)
        callback = untie.UntieCallback()
    elif mode == "emulated":  # the head exists (and is DDP-wrapped) from the start, kept tied until step 4
        callback = untie.UntieCallback(untie_when=None, untie_at=4, tying_mode="emulated")
    elif mode == "rates":  # per-role learning rates: the head, created after DDP wrapped the model, joins its group
        callback = untie.UntieCallback(untie_when=None, untie_at=4, embedding_lr_scale=0.5, head_lr_scale=2.0)
    else:
        callback = untie.UntieCallback(untie_when=None, untie_at=4)
    trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(n=128), callbacks=[callback])
    trainer.train()
    rank = int(os.environ["RANK"])
    layout = untie.embedding_layout(model)
    torch.save(
        {
            "distributed_type": trainer.accelerator.distributed_type.name,
            "untie_step": callback.untie_step,
            "untie_reason": callback.untie_reason,
            "policy_reason": callback.policy_choice.reason,
            "tying_mode": callback.tying_mode,
            "history": callback.history,
            "tied": untie.is_tied(model),
            "input": model.get_parameter(layout.input_weight).detach(),
            "output": model.get_parameter(layout.output_weight).detach(),
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "rates": [
                (h["step"], h["learning_rate"], h.get("untie/lr_input_embedding"), h.get("untie/lr_head"))
                for h in trainer.state.log_history
                if "loss" in h
            ],
            "role_groups": {g.get("untie_role"): len(g["params"]) for g in trainer.optimizer.param_groups},
        },  # fmt: skip
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    print(json.dumps({"rank": rank, "untie_step": callback.untie_step}))


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1], sys.argv[2], mode=sys.argv[3])
    worker_exit.finish()
