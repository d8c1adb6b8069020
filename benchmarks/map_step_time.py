"""The decision map's cost per optimizer step, by vocabulary and model shape: what sizes a map before it runs.

For each vocabulary size, builds (or reads from the cache) the map's corpus of `--sources` with that BPE vocabulary,
then for each (width, layers) trains the map's GPT-2 (`recipes/tasks/decision_map/training.py`) for `--steps` steps
of `--batch_size` blocks on one thread, after `--warmup` steps, and reports the mean step time, the parameters and
the embedding's share of them, and how many steps 10 tokens per parameter (issue 48's budget) takes and whether the
corpus holds them (single epoch).

    python benchmarks/map_step_time.py --sources shakespeare kjv debian-docs --vocabs 8192 32768 \\
        --shapes 64x2 128x2 256x4 --output_dir runs/bench-map-step
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers as tf
from common import machine, write_results

from untie_recipes.tasks.decision_map.corpus import BLOCK, default_cache_dir, load_corpus
from untie_recipes.tasks.decision_map.training import TrainingSetup, build_model


@dataclass
class Arguments:
    sources: list[str] = field(default_factory=lambda: ["shakespeare", "kjv"], metadata={"help": "corpus sources"})
    vocabs: list[int] = field(default_factory=lambda: [8192], metadata={"help": "BPE vocabulary sizes"})
    shapes: list[str] = field(default_factory=lambda: ["64x2", "256x4"], metadata={"help": "width x layers"})
    batch_size: int = field(default=8, metadata={"help": f"blocks of {BLOCK} tokens per step (the map's)"})
    steps: int = 20
    warmup: int = 3
    cache_dir: str | None = None
    output_dir: str = "runs/bench-map-step"


def step_time(corpus, width: int, layers: int, args: Arguments) -> dict:
    setup = TrainingSetup(width=width, layers=layers, heads=4, seed=1, batch_size=args.batch_size,
                          learning_rate=1e-3, warmup=1)  # fmt: skip
    model = build_model(setup, len(corpus.tokenizer), BLOCK, tied=True)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            started = time.perf_counter()
        ids = corpus.train[index * args.batch_size : (index + 1) * args.batch_size]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seconds = (time.perf_counter() - started) / args.steps
    steps_for_10 = 10 * params / (args.batch_size * BLOCK)
    return {
        "vocab": len(corpus.tokenizer), "width": width, "layers": layers, "params": params,
        "embedding_share": model.get_input_embeddings().weight.numel() / params, "seconds_per_step": seconds,
        "steps_for_10_tokens_per_param": round(steps_for_10),
        "fits_one_epoch": steps_for_10 * args.batch_size <= len(corpus.train),
    }  # fmt: skip


def main() -> None:
    (args,) = tf.HfArgumentParser(Arguments).parse_args_into_dataclasses()
    torch.set_num_threads(1)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    rows = []
    for vocab in args.vocabs:
        corpus = load_corpus(tuple(args.sources), cache, vocab)
        for shape in args.shapes:
            width, layers = (int(part) for part in shape.split("x"))
            rows.append({**step_time(corpus, width, layers, args), "train_tokens": corpus.train.numel()})
    lines = [
        f"Map step time on {machine()}, one thread, batch {args.batch_size} x {BLOCK} tokens, sources "
        f"{'+'.join(args.sources)}.",
        "",
        "| vocab | width x layers | params | embedding share | s/step | steps for 10 tokens/param | fits one epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['width']}x{r['layers']} | {r['params'] / 1e6:.2f}M | {r['embedding_share']:.0%} "
            f"| {r['seconds_per_step']:.3f} | {r['steps_for_10_tokens_per_param']} | {r['fits_one_epoch']} |"
        )
    write_results(args.output_dir, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
