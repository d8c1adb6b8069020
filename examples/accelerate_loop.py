"""Tie, then untie, in your own accelerate loop with `untie.Untier` (no Trainer): a small GPT-2 on the shipped text.

    python examples/accelerate_loop.py                                   # one process (CPU or one GPU)
    accelerate launch examples/accelerate_loop.py                        # your accelerate config (DDP, FSDP2, ...)
    torchrun --nproc_per_node 2 examples/accelerate_loop.py              # DDP
    python examples/accelerate_loop.py --resume_from runs/accelerate_loop/step-100   # resume a saved state

The Untier is created before the optimizer and `accelerator.prepare` (FSDP2 needs the head's parameter before
sharding), started after them, and stepped once per optimizer step. `accelerator.save_state` / `load_state` carry its
state; resumed before or after the untie, the run ends where the uninterrupted one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers as tf
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from tqdm.auto import tqdm

import untie
from untie import parse_command_line
from untie_recipes.offline import shakespeare_blocks  # the shipped Shakespeare text, as 64-token blocks
from untie_recipes.tasks.bookcorpus.data import load_tokenizer  # the shipped Shakespeare WordPiece vocabulary


@dataclass
class LoopArguments:
    output_dir: str = field(default="runs/accelerate_loop", metadata={"help": "Saved states go here."})
    max_steps: int = field(default=200, metadata={"help": "Optimizer steps."})
    batch_size: int = field(default=8, metadata={"help": "Micro-batch size per process."})
    accumulation: int = field(default=2, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW learning rate (linear decay)."})
    save_every: int = field(default=100, metadata={"help": "Save an accelerate state every this many steps."})
    resume_from: str | None = field(default=None, metadata={"help": "A folder written by accelerator.save_state."})
    seed: int = field(default=0, metadata={"help": "Model, data order."})


def main() -> None:
    (args,) = parse_command_line(LoopArguments)
    # The seedable sampler makes the data order a function of (seed, epoch), which save_state / load_state keep.
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # on CPU, torchrun then gives DDP on gloo (else one process per rank)
        gradient_accumulation_steps=args.accumulation,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(args.seed)
    tokenizer = load_tokenizer("offline")
    # No dropout (as in most pre-training today): a resumed run then draws no random numbers the uninterrupted one did
    # not, and ends bit-identical to it.
    config = tf.GPT2Config(
        vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    # Before the optimizer and prepare(). policy="off": the tied-phase schedule at its default values (the defaults
    # alone would train this model, built fresh, untied from the start): the tokenizer's case / word-start pairs feed
    # the evidence trigger, with a deadline at 30% of max_steps.
    untier = untie.Untier(model, max_steps=args.max_steps, accelerator=accelerator, tokenizer=tokenizer, policy="off")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    scheduler = linear_decay(optimizer, args.max_steps, accelerator.num_processes)
    loader = torch.utils.data.DataLoader(shakespeare_blocks(tokenizer), batch_size=args.batch_size, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    untier.start(optimizer)
    if args.resume_from:
        accelerator.load_state(args.resume_from)  # the model gets the saved run's tied or untied structure first
    done = untier.global_step
    batches_done = done * args.accumulation % len(loader)
    progress = tqdm(total=args.max_steps, initial=done, disable=not accelerator.is_main_process, desc="steps")
    while untier.global_step < args.max_steps:
        epoch = accelerator.skip_first_batches(loader, batches_done) if batches_done else loader
        batches_done = 0
        for batch in epoch:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            logs = untier.step()  # counts optimizer steps only; unties when the trigger fires or at the deadline
            if not accelerator.sync_gradients:
                continue
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}", tied=not untier.untied)
            if logs.get("untie/untie_step") == untier.global_step:
                progress.write(f"untied at step {untier.global_step} ({untier.untie_reason})")
            if untier.global_step % args.save_every == 0:
                accelerator.save_state(f"{args.output_dir}/step-{untier.global_step}")
            if untier.global_step >= args.max_steps:
                break
    progress.close()
    untier.close()
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        f"{args.output_dir}/final", is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )  # reloads untied with plain from_pretrained
    accelerator.print(
        f"{accelerator.distributed_type.name} on {accelerator.num_processes} process(es): untie step "
        f"{untier.untie_step} ({untier.untie_reason}); saved {args.output_dir}/final"
    )


def linear_decay(optimizer: torch.optim.Optimizer, max_steps: int, num_processes: int):
    """The learning rate from its value to 0 over `max_steps` optimizer steps, as accelerate steps it.

    A scheduler passed to `accelerator.prepare` is stepped `num_processes` times per optimizer step (accelerate
    assumes the global batch grew with the processes), so the schedule counts `max_steps * num_processes` steps;
    counting `max_steps` reached 0 at half the run on 2 ranks and went negative after it."""
    total = max_steps * num_processes
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))


if __name__ == "__main__":
    main()
