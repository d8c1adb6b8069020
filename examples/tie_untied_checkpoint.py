"""Tie an untied checkpoint and train it tied (optionally untie it again later with UntieCallback).

python examples/tie_untied_checkpoint.py                          # offline: builds a small untied GPT-2
python examples/tie_untied_checkpoint.py --init mean --untie_at 100
python examples/tie_untied_checkpoint.py --model_name_or_path EleutherAI/pythia-70m   # online: a real one

`--init` picks the shared matrix: the input embedding, the LM head, or their mean. The saved model stores one
matrix and reloads tied with plain `from_pretrained`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import transformers as tf

import untie
from untie import parse_command_line
from untie_recipes.offline import shakespeare_blocks, small_checkpoint


@dataclass
class ExampleArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "An untied causal-LM checkpoint; default: build a small one offline."}
    )
    output_dir: str = field(default="runs/tie_untied_checkpoint")
    init: str = field(default="mean", metadata={"help": "Shared matrix: input, output or mean."})
    untie_at: int | None = field(default=None, metadata={"help": "Untie again after this step (default: never)."})
    max_steps: int = field(default=200)
    learning_rate: float = field(default=5e-4)
    block_size: int = field(default=64)
    base_pretrain_steps: int = field(default=60, metadata={"help": "Pre-training of the offline base checkpoint."})
    seed: int = field(default=0)


def main() -> None:
    (args,) = parse_command_line(ExampleArguments)
    path = args.model_name_or_path or small_checkpoint(
        os.path.join(args.output_dir, "base"), tied=False, pretrain_steps=args.base_pretrain_steps, seed=args.seed
    )
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    print(f"{path}: tied = {untie.is_tied(model)}")
    untie.tie_embeddings(model, init=args.init)  # before the Trainer builds its optimizer
    print(f"after tie_embeddings(init={args.init!r}): tied = {untie.is_tied(model)}")

    callbacks = [untie.UntieCallback(untie_when=None, untie_at=args.untie_at)] if args.untie_at is not None else []
    training = tf.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=16,
        learning_rate=args.learning_rate,
        weight_decay=0.01,
        warmup_steps=min(20, args.max_steps // 10),
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
    )
    data = shakespeare_blocks(tokenizer, args.block_size)
    trainer = tf.Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    trainer.train()

    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    tokenizer.save_pretrained(final)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(final)
    summary = {
        "init": args.init,
        "untie_step": callbacks[0].untie_step if callbacks else None,
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "tied_at_end": untie.is_tied(model),
        "reloaded_tied": untie.is_tied(reloaded),
        "reloaded_embedding_intact": torch.equal(
            reloaded.get_input_embeddings().weight, model.get_input_embeddings().weight.cpu()
        ),
    }
    print(json.dumps(summary, indent=2))
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
