"""What the tie-then-untie study of issue 60 costs on this machine, before it is built: the Llama-style decoder
(transformers' `LlamaForCausalLM`: RMSNorm, rotary positions, SwiGLU) at a 32k vocabulary, trained on one thread for
`--steps` steps of `--batch_size` x `--block` tokens after `--warmup` steps, for each `--shapes` (width x layers).

For each shape it reports the parameters, the embedding's share, the tokens per second, and the core-hours of one run
at `--tokens_per_parameter`, and of one seed of the issue's arms (`ARM_RUNS`: tied, untied, the default, untie at 1/6,
1/3 and 2/3 branched from the tied run, and three optimizer-state levers branched at the best fraction, taken as 1/3),
so that a study is sized before it runs.

    python benchmarks/study_cost.py --shapes 64x2 128x4 256x8 --output_dir runs/bench-study-cost
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import machine, write_results

from untie_recipes.tasks.study.model import llama  # the study's decoder (recipes/study.py)

#: One seed of the issue's arms, in full runs: tied, untied and the default (untied from step 0 for a model built
#: fresh) run the whole budget; an untie at fraction f branches from the tied run and costs 1 - f; the three
#: optimizer-state levers branch at the best fraction (1/3 assumed here).
ARM_RUNS = 3 + (1 - 1 / 6) + (1 - 1 / 3) + (1 - 2 / 3) + 3 * (1 - 1 / 3)


@dataclass
class Arguments:
    shapes: list[str] = field(default_factory=lambda: ["64x2", "128x4", "256x8"], metadata={"help": "width x layers"})
    vocab: int = field(default=32768, metadata={"help": "vocabulary size (the issue asks for 32k or more)"})
    block: int = 128
    batch_size: int = 8
    steps: int = 5
    warmup: int = 2
    tokens_per_parameter: float = field(default=4.0, metadata={"help": "the budget (the issue: at least 4)"})
    output_dir: str = "runs/bench-study-cost"


def measure(width: int, layers: int, args: Arguments) -> dict:
    torch.manual_seed(0)
    model = llama(width, layers, args.vocab, args.block)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(args.vocab, (args.batch_size, args.block), generator=torch.Generator().manual_seed(0))
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tokens_per_second = args.steps * args.batch_size * args.block / (time.perf_counter() - started)
    run_hours = args.tokens_per_parameter * params / tokens_per_second / 3600
    return {
        "shape": f"{width}x{layers}", "params": params,
        "embedding_share": model.get_input_embeddings().weight.numel() / params,
        "tokens_per_second": tokens_per_second, "core_hours_per_run": run_hours,
        "core_hours_per_seed_of_arms": run_hours * ARM_RUNS,
    }  # fmt: skip


def main() -> None:
    (args,) = tf.HfArgumentParser(Arguments).parse_args_into_dataclasses()
    torch.set_num_threads(1)
    rows = [measure(*(int(part) for part in shape.split("x")), args) for shape in args.shapes]
    lines = [
        f"Study cost on {machine()}, one thread, Llama-style decoder, vocabulary {args.vocab:,}, batch "
        f"{args.batch_size} x {args.block} tokens, {args.tokens_per_parameter:g} tokens per parameter; one seed of the "
        f"arms = {ARM_RUNS:.2f} runs (`ARM_RUNS`).",
        "",
        "| width x layers | params | embedding share | tokens/s | core-hours per run | core-hours per seed of arms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['params']:,} | {r['embedding_share']:.0%} | {r['tokens_per_second']:,.0f} | "
            f"{r['core_hours_per_run']:.2f} | {r['core_hours_per_seed_of_arms']:.1f} |"
        )
    write_results(args.output_dir, {"arguments": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
