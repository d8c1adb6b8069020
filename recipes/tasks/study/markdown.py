"""The study's results as Markdown: `results.md` (one section per pool group and cell, the fine-tuning table, then the
verdict) and `summary.md` (the answer on one screen)."""

from __future__ import annotations

from untie_recipes.tasks.decision_map.corpus import BLOCK
from untie_recipes.tasks.study.protocol import CELLS, DEVELOPMENT_SEEDS


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _interval(paired: dict) -> str:
    if paired.get("mean") is None:
        return "-"
    if paired.get("low") is None:
        return f"{paired['mean']:+.4f}"
    return f"{paired['mean']:+.4f} [{paired['low']:+.4f}, {paired['high']:+.4f}]"


def _tokens(values: list[float | None]) -> str:
    return ", ".join("never" if v is None else f"{v / 1e6:.2f}M" for v in values)


def _sweep_lines(table: dict) -> list[str]:
    lines = ["| arm | LR: final validation loss (half budget) | best | note |", "|---|---|---|---|"]
    for arm, sweep in table["sweep"].items():
        losses = ", ".join(f"{lr}: {_num(loss)}" for lr, loss in sweep["losses"].items())
        lines.append(f"| {arm} | {losses} | {sweep['best']:g} | {sweep['note']} |")
    return lines


def _arm_lines(table: dict) -> list[str]:
    lines = [
        f"| arm | LR | untie step | mean | sd | vs the better of tied and untied ({table['reference']}; 95% t) | "
        "vs untied (95% t) | "
        "tokens to untied's final loss, per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, row in table["arms"].items():
        lines.append(
            f"| {arm} | {row['lr']:g} | {row['untie_step'] if row['untie_step'] is not None else '-'} | "
            f"{_num(row['mean'])} | {_num(row['sd'])} | {_interval(row['vs_reference'])} | "
            f"{_interval(row['vs_untied'])} | {_tokens(row['tokens_to_untied_final'])} |"
        )
    return lines


def _trigger_lines(table: dict) -> list[str]:
    lines = ["| seed | trigger would fire at | the former default's untie of a loaded model (now: step 0) | "
             "best fixed fraction (this seed) |",
             "|---|---|---|---|"]  # fmt: skip
    for row in table["trigger"]:
        fired = "never" if row["would_fire_step"] is None else (
            f"step {row['would_fire_step']} ({row['would_fire_fraction']:.1%})")  # fmt: skip
        lines.append(f"| {row['seed']} | {fired} | step {row['default_untie_step']} | {row['best_fixed']} "
                     f"(step {row['best_fixed_step']}) |")  # fmt: skip
    return lines


def cell_lines(table: dict) -> list[str]:
    lines = [f"### Cell {table['cell']}", ""]
    if "budget_steps" in table:
        lines += [
            f"{table['params']:,} parameters tied ({table['embedding_share']:.0%} in the embedding); budget "
            f"{table['budget_steps']:,} steps of {table['batch']} tokens = {table['tokens']:,} tokens, "
            f"{table['tokens_per_embedding_row']:.0f} tokens per embedding row, {table.get('epochs', 1.0):.2f} "
            f"passes over the training blocks. Complete seeds: {table['seeds']} "
            f"(recorded: {table['seeds_recorded']}); {table['core_hours']:.2f} core-hours ({table['wall_hours']:.2f} "
            "wall hours) recorded.",
            "",
        ]
    if table["sweep"]:
        lines += ["LR sweep (one development seed, half the budget):", "", *_sweep_lines(table), ""]
    if table["arms"]:
        lines += [f"Final validation loss over seeds {table['seeds']}; paired differences are the arm minus the "
                  "reference, seed by seed (< 0: the arm ends lower).", "", *_arm_lines(table), ""]  # fmt: skip
        lines += ["The trigger, measured on the tied run without acting:", "", *_trigger_lines(table), ""]
    return lines


def finetune_lines(table: dict) -> list[str]:
    """The fine-tuning table: per arm, where it untied, the target and source losses after fine-tuning (mean, sd and
    per seed) and their paired differences against staying tied."""
    if not table.get("arms"):
        return []
    before = "; ".join(f"seed {seed}: target {_num(b['target'])}, source {_num(b['source'])}"
                       for seed, b in table["before"].items())  # fmt: skip
    lines = [f"### Fine-tuning cell {table['cell']}'s tied checkpoints on the target (seeds {table['seeds']})", "",
             f"{table['steps']} steps of {table['batch_size']} x {BLOCK} tokens at LR {table['lr']:g}; "
             f"{table['core_hours']:.2f} core-hours. Before fine-tuning: {before}.", "",
             "| arm | untie step per seed | target loss mean (sd) | vs stay-tied (95% t) | source loss mean (sd) | "
             "vs stay-tied (95% t) | per seed: target / source |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, row in table["arms"].items():
        steps = ", ".join("-" if s is None else str(s) for s in row["untie_steps"])
        target, source = row["target"], row["source"]
        per_seed = "; ".join(f"{seed}: {_num(t)} / {_num(s)}" for seed, t, s in
                             zip(table["seeds"], target["per_seed"], source["per_seed"], strict=True))  # fmt: skip
        lines.append(f"| {arm} | {steps} | {_num(target['mean'])} ({_num(target['sd'])}) | "
                     f"{_interval(target['vs_stay_tied'])} | {_num(source['mean'])} ({_num(source['sd'])}) | "
                     f"{_interval(source['vs_stay_tied'])} | {per_seed} |")  # fmt: skip
    return [*lines, ""]


def markdown(results: dict) -> str:
    lines = ["# The tie-then-untie study: results", "", "Written by `python recipes/study.py --report_only`.", ""]
    for group in results["groups"]:
        lines += [f"## {group['cpu']}, kernels {group['kernel_path']}, {group['device']}, torch {group['torch']}", ""]
        lines += [f"Corpus blocks SHA-256 `{group['corpus_digest'][:16]}...`; {group['runs']} run(s).", ""]
        for table in group["cells"].values():
            lines += cell_lines(table)
        lines += finetune_lines(group.get("finetune") or {})
        verdict = group["verdict"]
        lines += ["### The rule's verdict", "", f"- fresh model: {verdict['fresh_model']} ({verdict['why']})",
                  f"- a copy at step 0: {verdict['copy_at_step_0']}", f"- loaded tied model: {verdict['loaded_model']}",
                  ""]  # fmt: skip
    return "\n".join(lines)


def _difference(interval: dict | None, reference: bool) -> str:
    """A summary cell: the mean paired difference, its 95% interval (2 seeds or more) or its one seed."""
    if reference:
        return "reference"
    if not interval or interval.get("mean") is None:
        return "pending"
    if interval.get("low") is None:
        return f"{interval['mean']:+.3f} (1 seed)"
    return f"{interval['mean']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"


def _seeds(column: dict) -> str:
    """The complete seeds of a summary column, or "none yet"."""
    return ", ".join(str(s) for s in column["seeds"]) or "none yet"


def summary_markdown(summaries: list[dict], groups: list[dict]) -> str:
    """`summary.md`: per pool group, each choice's paired difference in each pretraining cell and in fine-tuning,
    then the rule's answers."""
    lines = ["# The tie-then-untie study: the answer on one screen", "",
             "Written by `python recipes/study.py --report_only`.", ""]  # fmt: skip
    needed = len(DEVELOPMENT_SEEDS)
    for summary, group in zip(summaries, groups, strict=True):
        columns = summary["columns"]
        cells = [c for c in columns if not c.startswith("finetune-")]
        lines += [f"## {group['cpu']}, kernels {group['kernel_path']}, {group['device']}, torch {group['torch']}", ""]
        done = [f"cell {c} {len(columns[c]['seeds'])} of {needed}" for c in cells]
        done.append(f"fine-tuning {len(columns['finetune-target']['seeds'])} of {needed}")
        lines += [f"Complete seeds: {', '.join(done)}. The rule reads {needed} of each; until then these are records "
                  "and decide nothing.", ""]  # fmt: skip
        header = ["choice"]
        for cell in cells:
            shape = CELLS[cell]
            header.append(f"cell {cell} ({shape.width} x {shape.layers}, {shape.tokens_per_parameter:g} tokens per "
                          f"parameter; seeds {_seeds(columns[cell])}): loss vs untied")  # fmt: skip
        tuned = _seeds(columns["finetune-target"])
        header += [f"fine-tuning (seeds {tuned}): target loss vs stay tied", "fine-tuning: source loss vs stay tied"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for choice, pretraining, finetuning in summary["rows"]:
            row = [choice]
            for cell in cells:
                arms = CELLS[cell].arms
                if pretraining is None or pretraining not in arms:
                    row.append("-")
                else:
                    differences = columns[cell]["differences"]
                    reference = pretraining == "untied" and bool(columns[cell]["seeds"])
                    row.append(_difference(differences.get(pretraining), reference))
            for loss in ("target", "source"):
                if finetuning is None:
                    row.append("-")
                else:
                    column = columns[f"finetune-{loss}"]
                    reference = finetuning == "stay-tied" and bool(column["seeds"])
                    row.append(_difference(column["differences"].get(finetuning), reference))
            lines.append("| " + " | ".join(row) + " |")
        verdict = summary["verdict"]
        lines += ["", "| question | the rule's answer |", "|---|---|",
                  f"| a model trained from scratch | {verdict['fresh_model']} ({verdict['why']}) |",
                  f"| a copy at step 0 (a fresh model misread as trained) | {verdict['copy_at_step_0']} |",
                  f"| a loaded tied model (fine-tuning) | {verdict['loaded_model']} |", ""]  # fmt: skip
    return "\n".join(lines)
