"""Worker for test_deepspeed.py: `untie.Untier` in an accelerate loop with DeepSpeed ZeRO (`DeepSpeedPlugin`), under
`torchrun`, on CPU (gloo).

Usage: ``torchrun --nproc_per_node 2 deepspeed_untier_run.py OUT STAGE RUN``, RUN one of:

* ``full``: `Untier(untie_at=UNTIE_AT, untie_when=None)`, MAX_STEPS steps, `accelerator.save_state` after steps 4 and 8
  (before and after the untie), then the final model with `save_pretrained`;
* ``resume-4`` / ``resume-8``: a new process resumes from that save (`accelerator.load_state`) and finishes;
* ``tied``: the model really tied, no Untier: the reference for the tied phase;
* ``reset`` / ``fresh``: ``full`` with that `optimizer_state`, no saves;
* ``late``: the Untier created after `accelerator.prepare`, which must refuse (the head would never train);
* ``trigger``: `Untier(untie_when=RULE)` with no deadline, measuring every 2 steps, no saves.

Each run saves, per rank, its losses per step, the untie step and reason, the full fp32 matrices and Adam moments after
the untie step (DeepSpeed's `safe_get_full_*`), and the full matrices at the end.
"""

from __future__ import annotations

import os
import sys

import torch
import worker_exit
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from deepspeed_cpu import fix_process_index
from footprint import foreign_installs, foreign_installs_kept, library_leftovers

import untie
from untie.testing import TINY_MODELS, ToyLMDataset

UNTIE_AT, MAX_STEPS, SAVES = 6, 10, (4, 8)
RULE = untie.UntieWhen(signal="cosine", threshold=2.0, smoothing=0.0, warmup=0, patience=2)


def build_model():
    make_config, model_class = TINY_MODELS["gpt2"]
    config = make_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    return model_class(config)


def full_state(model) -> dict[str, torch.Tensor]:
    """The embedding's and the head's fp32 masters and Adam moments (collectives: every rank calls)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    roles = (("embedding", model.get_input_embeddings().weight), ("head", model.get_output_embeddings().weight))
    for name, param in roles:
        out[name] = safe_get_full_fp32_param(param).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).detach().clone()
    return out


def full_matrices(model) -> dict[str, torch.Tensor]:
    from untie.distributed import gathered

    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with gathered(embedding, head):  # ZeRO-3: every rank gathers
        return {"embedding": embedding.detach().clone(), "head": head.detach().clone()}


def main() -> None:
    worker_exit.start()
    fix_process_index()
    out, stage, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.3,  # bites: clipping must see the tied norm
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = build_model()
    untier = None
    if run == "late":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, optimizer = accelerator.prepare(model, optimizer)
        try:
            untie.Untier(engine, max_steps=MAX_STEPS, accelerator=accelerator, untie_at=UNTIE_AT, untie_when=None)
            message = None
        except (RuntimeError, ValueError) as error:
            message = str(error)
        torch.save({"error": message}, os.path.join(out, f"untier-z{stage}-{run}-rank{accelerator.process_index}.pt"))
        worker_exit.finish()
    foreign = foreign_installs(model) if run == "trigger" else None  # someone else's, before the run: kept
    if run != "tied":
        state = run if run in ("reset", "fresh") else "copy"
        schedule = {"untie_at": None, "untie_when": RULE, "metrics_every": 2, "pairs": [(3, 5), (7, 40)]}
        if run != "trigger":
            schedule = {"untie_at": UNTIE_AT, "untie_when": None}
        untier = untie.Untier(model, max_steps=MAX_STEPS, accelerator=accelerator, optimizer_state=state, **schedule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(ToyLMDataset(n=4 * 2 * MAX_STEPS), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if untier is not None:
        untier.start(optimizer)
    done, at_untie = 0, {}
    if run.startswith("resume-"):
        done = int(run.removeprefix("resume-"))
        accelerator.load_state(os.path.join(out, f"z{stage}-full-save{done}"))
        loader = accelerator.skip_first_batches(loader, done)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if untier is not None:
            untier.step()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        done += 1
        if done == UNTIE_AT and run != "trigger":
            at_untie = full_state(accelerator.unwrap_model(model))
        if run == "full" and done in SAVES:
            accelerator.save_state(os.path.join(out, f"z{stage}-full-save{done}"))
        if done == MAX_STEPS:
            break
    final = full_matrices(accelerator.unwrap_model(model))
    if run == "full":  # the final model, saved as accelerate's docs save one (gathered under ZeRO-3)
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(os.path.join(out, f"z{stage}-saved"), state_dict=state_dict)
        accelerator.wait_for_everyone()
    result = {"losses": torch.tensor(losses), "at_untie": at_untie, "final": final}
    if untier is not None:
        result.update(untie_step=untier.untie_step, reason=untier.untie_reason, tying_mode=untier.tying_mode)
        result["history"] = untier.history
        untier.close()
        result["leftovers"] = library_leftovers(model=model, optimizer=optimizer, accelerator=accelerator)
        result["foreign_kept"] = foreign_installs_kept(foreign) if foreign is not None else {}
    torch.save(result, os.path.join(out, f"untier-z{stage}-{run}-rank{accelerator.process_index}.pt"))
    worker_exit.finish()


if __name__ == "__main__":
    main()
