"""Fine-tune a tied checkpoint with its LM head untied: from the first step (`--untie_at 0`) or from a later step.

python examples/finetune_tied_checkpoint.py                                   # offline: builds a small tied GPT-2
python examples/finetune_tied_checkpoint.py --untie_at 100                    # fine-tune tied, untie at step 100
python examples/finetune_tied_checkpoint.py --model_name_or_path openai-community/gpt2   # online: a real one

The head starts as an exact copy of the shared matrix, so the loss does not jump at the untie. The saved model
reloads untied with plain `from_pretrained`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import transformers as tf

import untie
from untie import parse_command_line
from untie.checkpoints.inspection import describe
from untie_recipes.offline import shakespeare_blocks, small_checkpoint


@dataclass
class ExampleArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A tied causal-LM checkpoint; default: build a small one offline."}
    )
    output_dir: str = field(default="runs/finetune_tied_checkpoint")
    untie_at: int = field(default=0, metadata={"help": "0: untied from the first step; N: untie after step N."})
    max_steps: int = field(default=200)
    learning_rate: float = field(default=5e-4)
    block_size: int = field(default=64, metadata={"help": "Tokens per training example."})
    base_pretrain_steps: int = field(default=60, metadata={"help": "Pre-training of the offline base checkpoint."})
    seed: int = field(default=0)


def main() -> None:
    (args,) = parse_command_line(ExampleArguments)
    path = args.model_name_or_path or small_checkpoint(
        os.path.join(args.output_dir, "base"), tied=True, pretrain_steps=args.base_pretrain_steps, seed=args.seed
    )
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    print(f"{path}: tied = {untie.is_tied(model)}")

    callback = untie.UntieCallback(untie_when=None, untie_at=args.untie_at)
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
    trainer = tf.Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
    trainer.train()

    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    tokenizer.save_pretrained(final)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(final)
    report = describe(final)
    summary = {
        "untie_step": callback.untie_step,
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "reloaded_untied": not untie.is_tied(reloaded),
        "reloaded_head_intact": torch.equal(
            reloaded.get_output_embeddings().weight, model.get_output_embeddings().weight.cpu()
        ),
        "drift": report.get("drift"),
    }
    print(json.dumps(summary, indent=2))
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
