"""Pre-train a tiny GPT-2 tied, untie it at 30% of the run, and report what happened. Offline; 20 s wall on the
2-core development machine (`python examples/tie_then_untie.py`, CPU).

python examples/tie_then_untie.py [--max_steps 300] [--untie_at 0.3] [--output_dir runs/tie_then_untie]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import transformers as tf

import untie
from untie import parse_command_line

TEXT = """\
The miller rose before the sun and walked down to the river, where the wheel turned slowly in the dark water.
He listened to the wood groan and the stones grind, and he knew by the sound whether the grain was dry or damp.
His daughter kept the books and counted the sacks, and she knew by the numbers whether the year was good or bad.
In the spring the river ran high and fast, and the wheel turned so quickly that the whole house shook with it.
In the autumn the river ran low and slow, and the wheel turned so lazily that the miller could count each spoke.
The farmers came with their carts in the morning and went home with their flour in the evening, tired and glad.
One year the rain did not come, and the river shrank to a thread, and the wheel stood still for forty days.
The miller sat by the silent stones and the daughter sat by the silent books, and neither of them said a word.
Then the rain came at last, first softly and then all at once, and the river rose, and the wheel began to turn.
"""


@dataclass
class ExampleArguments:
    output_dir: str = field(default="runs/tie_then_untie", metadata={"help": "Where checkpoints and summary go."})
    max_steps: int = field(default=300, metadata={"help": "Optimizer steps."})
    untie_at: float = field(default=0.3, metadata={"help": "Untie step: an int, or a fraction of max_steps."})
    optimizer_state: str = field(default="copy", metadata={"help": "Untied head's optimizer state: copy or reset."})
    seq_len: int = field(default=64, metadata={"help": "Characters per training sequence."})
    seed: int = 0


class CharDataset(torch.utils.data.Dataset):
    """Overlapping character windows of TEXT; the character vocabulary is the tokenizer."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        self.windows = ids.unfold(0, seq_len, seq_len // 4)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i].clone()}


def main() -> None:
    (args,) = parse_command_line(ExampleArguments)
    untie_at = int(args.untie_at) if args.untie_at >= 1 else args.untie_at
    tf.set_seed(args.seed)
    data = CharDataset(TEXT, args.seq_len)
    config = tf.GPT2Config(
        vocab_size=len(data.vocab),
        n_positions=args.seq_len,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = tf.GPT2LMHeadModel(config)
    training = tf.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=max(1, args.max_steps // 20),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
    )
    callback = untie.UntieCallback(untie_when=None, untie_at=untie_at, optimizer_state=args.optimizer_state)
    trainer = tf.Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
    print(f"model tied at start: {untie.is_tied(model)}")
    trainer.train()

    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    drift = ((head - embedding).norm() / embedding.norm()).item()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    reloaded = tf.GPT2LMHeadModel.from_pretrained(os.path.join(args.output_dir, "final"))
    summary = {
        "untie_step": callback.untie_step,
        "tied_at_end": untie.is_tied(model),
        "loss_first": losses[min(losses)],
        "loss_at_untie": losses.get(callback.untie_step),
        "loss_last": losses[max(losses)],
        "head_vs_embedding_relative_distance": round(drift, 4),
        "reloaded_untied": not untie.is_tied(reloaded),
        "reloaded_head_intact": torch.equal(reloaded.lm_head.weight, head.detach().cpu()),
    }
    print(json.dumps(summary, indent=2))
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
