"""The per-role learning rates on each single-process route, measured: for each route, the rates the embedding's and
the head's groups trained at (read by an optimizer step post-hook) at three steps across warm-up and decay, beside
scale x the source group's rate at that step, and the largest parameter difference of a resume from a checkpoint
after the untie against the uninterrupted run. The distributed routes (DDP, FSDP2) are checked by
`tests/test_role_rates.py` and `tests/test_fsdp2.py` the same way.

    python scripts/role_rate_routes.py            # a Markdown table on standard output (about a minute)
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import transformers as tf

import untie
from untie.structure.role_rates import ROLE_KEY
from untie.structure.surgery import inner_optimizer
from untie.testing import ToyLMDataset, tiny_model

SCALES = {"embedding_lr_scale": 0.1, "head_lr_scale": 2.0}
STEPS, UNTIE_AT, WARMUP, SHOWN = 12, 3, 4, (2, 5, 11)


class StepRates:
    """Each step's (source rate, embedding group's rate, head group's rate), read after the follower set them."""

    def __init__(self, optimizer) -> None:
        self.rows: dict[int, tuple] = {}
        inner_optimizer(optimizer).register_step_post_hook(self.record)

    def record(self, optimizer, *_):
        roles = {g.get(ROLE_KEY): g["lr"] for g in optimizer.param_groups}
        self.rows[len(self.rows) + 1] = (optimizer.param_groups[0]["lr"], roles["input_embedding"], roles["head"])


def trainer_route(folder: str, resume: str | None = None, passed: bool = False):
    model = tiny_model("gpt2")
    args = tf.TrainingArguments(folder, max_steps=STEPS, per_device_train_batch_size=8, learning_rate=5e-3,
                                warmup_steps=WARMUP, lr_scheduler_type="cosine", save_strategy="steps", save_steps=6,
                                report_to=[], use_cpu=True, disable_tqdm=True, seed=0, logging_steps=100)  # fmt: skip
    optimizers = (None, None)
    if passed:
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        optimizers = (optimizer, tf.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS))
    callback = untie.UntieCallback(untie_at=UNTIE_AT, untie_when=None, **SCALES)
    seen: list[StepRates] = []

    class Watch(tf.TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            seen.append(StepRates(optimizer))

    trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback, Watch()],
                         optimizers=optimizers)  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return model, seen[0].rows


def untier_route(built_first: bool):
    model = tiny_model("llama")
    data = ToyLMDataset(n=8)
    settings = dict(untie_at=UNTIE_AT, untie_when=None, max_steps=STEPS, **SCALES)
    if built_first:
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        scheduler = tf.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)
        untier = untie.Untier(model, optimizer, lr_scheduler=scheduler, **settings)
    else:
        untier = untie.Untier(model, **settings)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        scheduler = tf.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)
        untier.start(optimizer, lr_scheduler=scheduler)
    rates = StepRates(optimizer)
    for _ in range(STEPS):
        model(input_ids=data.ids, labels=data.ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        untier.step()
    return rates.rows


def main() -> None:
    torch.set_num_threads(1)
    rows, resumes = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, passed in (("Trainer builds the optimizer", False), ("Trainer(optimizers=(opt, sched))", True)):
            path = os.path.join(folder, name.split()[0] + str(passed))
            model, rows[name] = trainer_route(path, passed=passed)
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
            resumed, _ = trainer_route(path, resume=os.path.join(path, "checkpoint-6"), passed=passed)
            resumes[name] = max((p.detach() - final[n]).abs().max().item() for n, p in resumed.named_parameters())
    rows["Untier(model, optimizer, lr_scheduler=...)"] = untier_route(built_first=True)
    rows["Untier(model); start(optimizer, lr_scheduler=...)"] = untier_route(built_first=False)
    print(
        f"Untie at step {UNTIE_AT} of {STEPS}, warm-up {WARMUP} then cosine; embedding_lr_scale 0.1, head_lr_scale 2."
    )
    print("Before the untie the roles train at 1x (the head has no parameter of its own yet).\n")
    print("| route | step | group rate | embedding: expected / actual | head: expected / actual | resume max diff |")
    print("|---|---|---|---|---|---|")
    for name, table in rows.items():
        for step in SHOWN:
            source, embedding, head = table[step]
            scale_e, scale_h = (0.1, 2.0) if step > UNTIE_AT else (1.0, None)
            head_text = f"{scale_h * source:.6g} / {head:.6g}" if scale_h else "- (tied)"
            diff = f"{resumes[name]:.1e}" if name in resumes and step == SHOWN[-1] else ""
            print(
                f"| {name} | {step} | {source:.6g} | {scale_e * source:.6g} / {embedding:.6g} | {head_text} | {diff} |"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
