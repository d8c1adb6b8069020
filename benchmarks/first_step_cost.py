"""What the default costs a model built fresh at today's vocabularies, on one thread: the attach (the freshness
evidence, the untie and the head's draw) against one copy of the embedding, and the first-batch check of the drawn head
(`untie.structure.head_start`) against one training step.

    python benchmarks/first_step_cost.py --shapes 262144x2304 128256x4096 --output_dir runs/bench-first-step

Per shape: a tied one-layer Llama with that embedding, in `--dtype`, trained by SGD at learning rate 0 (every step
computes all it would, and no weight moves), on one batch of `--tokens` tokens. Timed: one copy of the embedding (the
best of 3); `Untier(model, max_steps=10)` (the attach), and the head's draw inside it; the check (the output module's
pre-hook, which scores the batch with both heads and decides); a training step after the untie, without the check
(the best of 2).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import machine, write_results

import untie
from untie.core import model_structure
from untie.structure import head_start


@dataclass
class Arguments:
    shapes: list[str] = field(default_factory=lambda: ["262144x2304", "128256x4096"], metadata={"help": "rows x width"})
    dtype: str = field(default="bfloat16", metadata={"help": "the model's dtype (bfloat16: as checkpoints ship)"})
    tokens: int = field(default=128, metadata={"help": "tokens in the training batch (one row)"})
    output_dir: str = "runs/bench-first-step"


class Timed:
    """Wraps `owner.name` (a function or a method) to add up the seconds its calls take."""

    def __init__(self, owner: object, name: str) -> None:
        self.seconds = 0.0
        self.owner, self.name, self.original = owner, name, getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return timer.original(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - started

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)


def timed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    started = time.perf_counter()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def measure(rows: int, width: int, args: Arguments) -> dict:
    """The attach, the check and the costs they are held against, for one (rows, width) embedding."""
    config = tf.LlamaConfig(
        vocab_size=rows, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=args.tokens, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    embedding = model.get_input_embeddings().weight
    copies = []
    for _ in range(3):
        started = time.perf_counter()
        embedding.detach().clone()
        copies.append(time.perf_counter() - started)
    batch = torch.randint(rows, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    # The check: the output module's pre-hook at the first forward. The draw: `draw_head`, inside the attach.
    check, draw = Timed(head_start.FirstBatchCheck, "_before_head"), Timed(model_structure, "draw_head")
    try:
        started = time.perf_counter()
        untier = untie.Untier(model, max_steps=10)
        attach = time.perf_counter() - started
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        untier.start(optimizer)
        first = timed_step(model, optimizer, batch)
        untier.step()
        steps = [timed_step(model, optimizer, batch) for _ in range(2)]
    finally:
        check.restore()
        draw.restore()
    verdict = untier.policy_choice.head_init
    return {
        "shape": f"{rows}x{width}", "dtype": args.dtype, "tokens": args.tokens, "head_start": verdict,
        "copy_seconds": min(copies), "attach_seconds": attach, "draw_seconds": draw.seconds,
        "check_seconds": check.seconds,
        "first_step_seconds": first, "step_seconds": min(steps),
    }  # fmt: skip


def main() -> None:
    (args,) = tf.HfArgumentParser(Arguments).parse_args_into_dataclasses()
    torch.set_num_threads(1)
    logging.getLogger("untie").setLevel(logging.ERROR)
    rows = [measure(*(int(part) for part in shape.split("x")), args) for shape in args.shapes]
    lines = [
        f"The default on a model built fresh, on {machine()}, one thread, {args.dtype}, {args.tokens} tokens a step.",
        "",
        "| rows x width | one copy of the embedding (s) | attach (s) | of which the head's draw (s) | attach / copy | "
        "training step (s) | first-batch check (s) | check / step | head start |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['shape']} | {r['copy_seconds']:.2f} | {r['attach_seconds']:.2f} | {r['draw_seconds']:.2f} | "
        f"x{r['attach_seconds'] / r['copy_seconds']:.2f} | {r['step_seconds']:.2f} | {r['check_seconds']:.2f} | "
        f"x{r['check_seconds'] / r['step_seconds']:.2f} | {r['head_start']} |"
        for r in rows
    ]
    write_results(args.output_dir, {"arguments": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
