"""What the default's head start costs on weights whose embedding a few steps barely move (issue 78, item 4), and
whether it ever calls a fresh model of large spread trained.

Each lightly trained case builds a tied model, trains it a few AdamW steps on the step task (`untie.testing.
step_task`), and hands its weights over by hand (`load_state_dict` into a fresh instance: no name says "loaded"); the
run (`Untier(model, max_steps=10, policy="untie-at-start")`: untied at step 0, as the default does to every loaded
model and to a fresh one in its untied bands) then starts the head, and the first forward's loss is compared with the
trained model's own on the same batch: "lost" is what the head the run starts with costs at the first step (0 where it
keeps the trained head, a copy). Each fresh case attaches the same run to a model built fresh and reports the start
it chose ("model": drawn, as a fresh model should be).

    python benchmarks/lightly_trained.py --seeds 0 1 2 --output_dir runs/bench-lightly-trained
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import machine, write_results

import untie
from untie.testing import step_batch, step_model

#: (family, initialiser setting, AdamW steps, learning rate): the hand-overs issue 78 named.
TRAINED_CASES = [("t5", None, 3, 1e-3), ("t5", None, 10, 3e-4), ("llama", 0.2, 1, 1e-3), ("llama", 0.2, 3, 1e-3),
                 ("llama", 0.2, 10, 1e-3)]  # fmt: skip
#: (family, initialiser setting): fresh models whose embedding has a large or a small spread.
FRESH_CASES = [("t5", None), ("t5", 10.0), ("llama", 0.2), ("llama", 0.002), ("llama", None)]


@dataclass
class Arguments:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "a seed per case's draw"})
    output_dir: str = "runs/bench-lightly-trained"


def first_step(model: tf.PreTrainedModel, family: str, seed: int) -> tuple[str, float]:
    """The head start the default chooses for `model`, and the loss of its first forward on the case's batch."""
    untier = untie.Untier(model, max_steps=10, policy="untie-at-start")
    untier.start(torch.optim.SGD(model.parameters(), lr=0.0))
    loss = model(**step_batch(family, 5000 + seed)).loss.item()
    start = untier.run.decision.head_init
    untier.close()
    return start, loss


def trained_case(family: str, init: float | None, steps: int, lr: float, seed: int) -> dict:
    trained = step_model(family, seed, init)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=lr)
    for step in range(steps):
        trained(**step_batch(family, 1000 + 50 * seed + step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        own = trained(**step_batch(family, 5000 + seed)).loss.item()
    handed = step_model(family, seed + 7777, init)
    handed.load_state_dict(trained.state_dict())
    start, loss = first_step(handed, family, seed)
    return {"case": f"{family} {init or 'default'} init, {steps} steps at {lr:g}", "seed": seed, "start": start,
            "trained_loss": own, "first_loss": loss, "lost": loss - own}  # fmt: skip


def main() -> None:
    (args,) = tf.HfArgumentParser(Arguments).parse_args_into_dataclasses()
    warnings.filterwarnings("ignore")
    logging.getLogger("untie").setLevel(logging.ERROR)
    trained = [trained_case(*case, seed) for case in TRAINED_CASES for seed in args.seeds]
    fresh = [
        {"case": f"{family} {init or 'default'} init, fresh", "seed": seed,
         "start": first_step(step_model(family, seed, init), family, seed)[0]}
        for family, init in FRESH_CASES for seed in args.seeds
    ]  # fmt: skip
    lines = [f"The default's head start after a hand-over by hand, on {machine()}; seeds {args.seeds}.", "",
             "| lightly trained case | seed | head start | trained loss | first-step loss | lost (nat) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['case']} | {r['seed']} | {r['start']} | {r['trained_loss']:.4f} | {r['first_loss']:.4f} | "
              f"{r['lost']:+.4f} |" for r in trained]  # fmt: skip
    worst = max(r["lost"] for r in trained)
    copies = sum(r["start"] != "model" for r in fresh)
    lines += ["", f"Worst lost: {worst:+.4f} nat. Fresh models given a copy: {copies} of {len(fresh)}.",
              "", "| fresh case | seeds drawn |", "|---|---|"]  # fmt: skip
    for family, init in FRESH_CASES:
        name = f"{family} {init or 'default'} init, fresh"
        rows = [r for r in fresh if r["case"] == name]
        lines.append(f"| {name} | {sum(r['start'] == 'model' for r in rows)} of {len(rows)} |")
    write_results(args.output_dir, {"arguments": vars(args), "trained": trained, "fresh": fresh}, "\n".join(lines))


if __name__ == "__main__":
    main()
