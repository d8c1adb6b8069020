"""Regenerate, or check, the results tables of the docs from the commands that write them.

Every generated table sits in its page between two markers, with its command written next to it:

    <!-- table: exor-quick -->
    | variant | model | arm | ... |
    <!-- end table: exor-quick -->

and its name is an entry of `TABLES` below: the commands, the file (or standard output) the last one writes, and how
the table is read from it. A table is never edited by hand; a change that alters what it reports regenerates it:

    python scripts/docs_tables.py --write exor-quick      # run the commands, replace the table in its page
    python scripts/docs_tables.py --check --cheap         # what CI runs: the cheap tables must equal their commands'
    python scripts/docs_tables.py --check exor-trigger    # an expensive one, on demand
    python scripts/docs_tables.py --list                  # every table: page, cost, commands, the commit that wrote it
    python scripts/docs_tables.py --write decision-map --from runs/decision-map   # read a finished run's report

Only tables whose numbers are deterministic (same seed, same numbers on a machine kind, whatever the worker count)
are checked, and CI checks only those that hold on any x86 CPU kind (a chaotic single-seed run's numbers do not:
float kernels differ between CPU kinds; its page names the kind they are exact on); timings are measurements,
dated by the commit and machine written next to them. The tables that are not cheap (tens of minutes to hours on
2 cores) are not run by CI: each page names the commit its table was made on, and
`tests/test_docs_tables.py` fails on a results table of README or docs that is not registered here.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def first_table(text: str) -> str:
    """The first Markdown table of a file: its consecutive lines that start with `|`."""
    lines, started = [], False
    for line in text.splitlines():
        if line.startswith("|"):
            lines.append(line)
            started = True
        elif started:
            break
    if not lines:
        raise ValueError("the command's output holds no Markdown table")
    return "\n".join(lines)


def without_columns(*names: str, index: int = 0) -> Callable[[str], str]:
    """The `index`-th table (0: the first) without the named columns: timings (measurements, not results a seed
    fixes), or the numbers of a claim's evidence, which differ between CPU kinds where the verdict does not."""

    def extract(text: str) -> str:
        lines = nth_table(index)(text).splitlines()
        rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
        keep = [i for i, name in enumerate(rows[0]) if name not in names]
        kept = ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
        kept[1] = "|" + "---|" * len(keep)  # the header separator
        return "\n".join(kept)

    return extract


def nth_table(index: int) -> Callable[[str], str]:
    """The `index`-th Markdown table of a file (0: the first), for a command that writes several."""

    def extract(text: str) -> str:
        tables = re.findall(r"(?:^\|.*(?:\n|$))+", text, flags=re.M)
        if len(tables) <= index:
            raise ValueError(f"the command's output holds {len(tables)} Markdown table(s), not {index + 1}")
        return tables[index].strip()

    return extract


def claims_checked(text: str) -> str:
    """An EXor claims table (the second table of its results.md) as which claims the run checked: each claim with
    "yes" where it has a verdict (holds or fails) and "no" where it is not tested. Unlike the verdicts and their
    numbers, it follows only whether each run learned the task: the same on the two CPU kinds recorded (observed, not
    guaranteed: a run near the edge of learning could differ)."""
    lines = nth_table(1)(text).splitlines()
    rows = ["| claim | checked |", "|---|---|"]
    for line in lines[2:]:
        claim, holds = (cell.strip() for cell in line.strip().strip("|").split(" | ")[:2])
        rows.append(f"| {claim} | {'yes' if holds in ('yes', '**no**') else 'no'} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class Table:
    """A table of the docs and the commands that write it."""

    page: str
    """The page, relative to the repository root."""
    commands: tuple[tuple[str, ...], ...]
    """The commands, run in order from the repository root; `{out}` is a fresh folder (shown as `runs` in the page)."""
    output: str | None
    """The file the last command writes the table into, relative to `{out}`; None: its standard output."""
    extract: Callable[[str], str] = first_table
    cost: str = "expensive"
    """"cheap": minutes on 2 cores, holds on any x86 CPU, CI checks it; "cpu-kind": minutes, but exact only on the CPU
    kind its page names (chaotic single-seed numbers: float kernels differ between CPU kinds), checked on demand
    on that kind (`--check NAME`); "expensive": tens of minutes to hours, deterministic, checked on
    demand (`--check NAME`); "timing": a measurement (wall times), regenerated by `--write`, never compared;
    "record": assembled from the commands' reports at the commit its page names, kept as a record of a setting
    the code has since changed (neither checked nor written); "data": read from committed records by a report that
    trains nothing (seconds, no float kernel choices), so it holds on any machine: CI checks it, and a commit that
    adds records regenerates it."""

    def shell(self) -> list[str]:
        """The commands as the page writes them."""
        return [
            " ".join(command)
            .replace("{out}/", "runs/")
            .replace(" --output_dir {out}", "")
            .replace(" --disable_tqdm", "")
            for command in self.commands
        ]


def _exor(*args: str) -> tuple[str, ...]:
    return ("python", "recipes/exor.py", *args, "--disable_tqdm")


#: The four runs of the trigger table: EXor auto arms, 5 seeds, two presets and two budgets each.
_TRIGGER_RUNS = (
    _exor(*"--arms auto --variants main ndh ydh --seeds 42 43 44 45 46 --max_steps 4000".split(), "--output_dir",
          "{out}/exor-4k"),
    _exor(*"--arms auto --variants main ndh ydh --seeds 42 43 44 45 46".split(), "--output_dir", "{out}/exor-20k"),
    _exor(*"--preset paper --arms auto --variants main ndh --seeds 42 43 44 45 46 --max_steps 10000".split(),
          "--output_dir", "{out}/exor-paper-10k"),
    _exor(*"--preset paper --arms auto --variants ydh --seeds 42 43 44 45 46".split(), "--output_dir",
          "{out}/exor-paper-150k"),
)  # fmt: skip


#: The quick preset's model (the MLP-Mixer) tied, on development seeds 1 and 2, under the paper's schedule compressed
#: 3.75x to 15x (steps / c, peak learning rate 5e-4 c, half-period 10,000 / c; 7.5x is the quick preset itself).
_MIXER_TIED_SCHEDULES = tuple(
    _exor("--models", "mixer", "--arms", "tied", "--seeds", "1", "2", *flags, "--output_dir", f"{{out}}/{name}")
    for name, flags in (
        ("mixer-tied-40k", ("--max_steps", "40000", "--learning_rate", "1.875e-3", "--cosine_steps", "2667")),
        ("mixer-tied-30k", ("--max_steps", "30000", "--learning_rate", "2.5e-3", "--cosine_steps", "2000")),
        ("mixer-tied-20k", ()),
        ("mixer-tied-15k", ("--max_steps", "15000", "--learning_rate", "5e-3", "--cosine_steps", "1000")),
        ("mixer-tied-10k", ("--max_steps", "10000", "--learning_rate", "7.5e-3", "--cosine_steps", "667")),
    )
)


def _clm_seed(seed: int) -> tuple[str, ...]:
    return (
        "python", "recipes/bookcorpus.py", "--objective", "clm", "--auto_pairs", "tokenizer", "--max_steps", "400",
        "--cosine_steps", "400", "--batch_size", "16", "--metrics_every", "25", "--disable_tqdm", "--seed", str(seed),
        "--output_dir", f"{{out}}/clm400-{seed}",
    )  # fmt: skip


#: The decision map (hours on 2 cores): every arm at d 64 and 256, seeds 1-3; its report holds three tables.
_MAP = (("python", "recipes/decision_map.py", "--policy", "off", "--output_dir", "{out}", "--disable_tqdm"),)
#: The map's arms that untie again with `optimizer_state="fresh"`, at d 64 (the tied and untied runs rerun too).
_MAP_FRESH = (
    ("python", "recipes/decision_map.py", "--widths", "64", "--optimizer_state", "fresh", "--output_dir", "{out}",
     "--disable_tqdm"),
)  # fmt: skip


#: The untie policy's development cells (issue 48): per cell, the map's tied, untied and default runs, then the runs
#: untied from the start with the head copied from the embedding and drawn by the model's initialiser (what
#: `policy="auto"` does above its share for a freshly built model); the tables pair them by seed.
_POLICY_CORPUS = ("--sources", "shakespeare", "kjv", "debian-docs", "--budgets", "250", "500", "1000")


def _policy_dev_cell(width: str, layers: str, head_init: str, seeds: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """One development cell: the map's three runs, then the run untied from the start with the head `head_init`."""
    common = ("python", "recipes/decision_map.py", *_POLICY_CORPUS, "--widths", width, "--layers", layers, "--seeds",
              *seeds, "--policy", "off", "--output_dir", f"{{out}}/dev-d{width}x{layers}",
              "--disable_tqdm")  # fmt: skip
    start = (*common, "--arms", "auto", "--untie_at", "0", "--untie_when", "none")
    return (*common, "--arms", "tied", "untied", "auto"), (
        *start,
        "--head_init",
        head_init,
    ) if head_init == "model" else start


def _policy_table(head_init: str, output: str) -> tuple[str, ...]:
    return ("python", "scripts/policy_table.py", "{out}/dev-d128x2", "{out}/dev-d128x4", "--head_init", head_init,
            "--output", f"{{out}}/{output}")  # fmt: skip


def _policy_dev(head_init: str, seeds: tuple[str, ...], output: str) -> tuple[tuple[str, ...], ...]:
    cells = (*_policy_dev_cell("128", "2", head_init, seeds), *_policy_dev_cell("128", "4", head_init, seeds))
    return (*cells, _policy_table(head_init, output))


#: The policies' held-out validations (issue 48, each fixed in docs/recipes/decision-map.md before it ran): shapes
#: never used in development, as (width, layers, vocabulary or None for the map's), every arm.
_HELDOUT_SHAPES = (("64", "4", None), ("256", "2", None), ("128", "8", None))
_HELDOUT2_SHAPES = (("128", "12", None), ("64", "4", "32768"))


def _heldout_folder(prefix: str, width: str, layers: str, vocab: str | None) -> str:
    return f"{{out}}/{prefix}-d{width}x{layers}" + ("" if vocab is None else f"-v{int(vocab) // 1024}k")


def _policy_heldout(
    prefix: str = "heldout",
    shapes: tuple = _HELDOUT_SHAPES,
    seeds: tuple[str, ...] = ("7", "8", "9"),
    policy: str = "auto",
    view: str = "--validation",
    output: str = "policy-heldout.md",
) -> tuple[tuple[str, ...], ...]:
    """The map commands of a held-out validation, then its table (`view`: --validation, or --per_seed from the
    records, a shape's seeds need not all be finished)."""
    folders = tuple(_heldout_folder(prefix, *shape) for shape in shapes)
    maps = tuple(
        ("python", "recipes/decision_map.py", *_POLICY_CORPUS, *(() if vocab is None else ("--vocab_size", vocab)),
         "--widths", width, "--layers", layers, "--seeds", *seeds, "--policy", policy, "--output_dir", folder,
         "--disable_tqdm")
        for (width, layers, vocab), folder in zip(shapes, folders, strict=True)
    )  # fmt: skip
    policy_flag = () if policy == "auto" else ("--policy", policy)
    table = ("python", "scripts/policy_table.py", view, *policy_flag, *folders, "--output", f"{{out}}/{output}")
    return (*maps, table)


def _fresh_untied_heldout(view: str = "", output: str = "") -> tuple[tuple[str, ...], ...]:
    """`policy="fresh-untied"`'s held-out validation (seeds 10-12 of `_HELDOUT2_SHAPES`): its maps, then the `view`
    table written to `output` (no table without a view)."""
    commands = _policy_heldout("heldout2", _HELDOUT2_SHAPES, ("10", "11", "12"), "fresh-untied", view, output)
    return commands if view else commands[:-1]


#: The frozen checkout of the pre-registered candidate (commit 1296c8f) that `scripts/map_on_device.py` runs on a GPU.
_FROZEN = "/tmp/untie-1296c8f"
_ON_GPU = ("env", "MAP_DEVICE=cuda", f"MAP_CODE={_FROZEN}", "CUBLAS_WORKSPACE_CONFIG=:4096:8", "python",
           "scripts/map_on_device.py")  # fmt: skip


def _on_gpu(folder: str, width: str, layers: str, seeds: tuple[str, ...], *extra: str) -> tuple[str, ...]:
    """A map of `policy="fresh-untied"` run on a GPU by `scripts/map_on_device.py`, on the frozen checkout."""
    budgets = () if "--budgets" in extra else _POLICY_CORPUS[4:]
    return (*_ON_GPU, *_POLICY_CORPUS[:4], *budgets, *extra, "--widths", width, "--layers", layers, "--seeds",
            *seeds, "--policy", "fresh-untied", "--output_dir", f"{{out}}/{folder}", "--disable_tqdm")  # fmt: skip


def _gpu_maps(cells: tuple[tuple[str, tuple[str, ...]], ...], output: str) -> tuple[tuple[str, ...], ...]:
    """The frozen checkout, the GPU maps of `cells` ((folder, map flags)), then their per-seed table."""
    checkout = ("git", "worktree", "add", "--force", _FROZEN, "1296c8f")
    maps = tuple(_on_gpu(folder, *flags) for folder, flags in cells)
    folders = tuple(f"{{out}}/{folder}" for folder, _ in cells)
    table = ("python", "scripts/policy_table.py", "--per_seed", "--policy", "fresh-untied", *folders, "--output",
             f"{{out}}/{output}")  # fmt: skip
    return (checkout, *maps, table)


#: Seed 10 of both held-out shapes again, on a GPU: how far a device moves the map's numbers (not in the verdict).
_GPU_CHECK = (
    ("heldout2-gpu-check-d128x12", ("128", "12", ("10",))),
    ("heldout2-gpu-check-d64x4-v32k", ("64", "4", ("10",), "--vocab_size", "32768")),
)
#: Development cells the earlier maps lacked (issue 48's wider map): a 21% embedding share, and 9.7 tokens per
#: parameter (6,000 steps of d 64 x 2); tied, untied and the candidate only.
_GPU_DEV = (
    ("dev-d128x20", ("128", "20", ("1", "2", "3"), "--arms", "tied", "untied", "auto")),
    ("dev-d64x2-long", ("64", "2", ("1", "2", "3"), "--arms", "tied", "untied", "auto", "--budgets", "1000", "3000",
                        "6000")),
)  # fmt: skip


def _tie_then_untie() -> tuple[tuple[str, ...], ...]:
    """Every map with a tied phase on the corpus with Debian's manuals (the policy's development cells, both held-out
    validations), then every tie-then-untie arm of their reports against the better of tied and untied, seed by
    seed (issue 48's second criterion, asked of every arm)."""
    dev = tuple(_policy_dev_cell("128", layers, "model", ("1", "2"))[0] for layers in ("2", "4"))
    heldout = _policy_heldout()[:-1]
    heldout2 = _fresh_untied_heldout()
    folders = (
        "{out}/dev-d128x2",
        "{out}/dev-d128x4",
        *(_heldout_folder("heldout", *shape) for shape in _HELDOUT_SHAPES),
        *(_heldout_folder("heldout2", *shape) for shape in _HELDOUT2_SHAPES),
    )
    table = ("python", "scripts/policy_table.py", "--tie_then_untie", *folders, "--output", "{out}/tie-then-untie.md")
    return (*dev, *heldout, *heldout2, table)


#: The extra memory of a DeepSpeed measuring step, ZeRO-2 and ZeRO-3 on 2 CPU ranks (docs/benchmarks.md).
_DEEPSPEED_MEMORY = (
    "python",
    "benchmarks/deepspeed_measurement_memory.py",
    "--stages",
    "2",
    "3",
    "--output_dir",
    "{out}",
)
#: The EXor quick preset, the README's first line's job (its tables in docs/recipes/exor.md).
_EXOR_QUICK = (_exor("--output_dir", "{out}"),)


def _map_tables(name: str, commands: tuple[tuple[str, ...], ...], output: str) -> dict[str, Table]:
    """The three tables of a decision-map report: the cells, the auto arm's untie steps, the paired differences."""
    page = "docs/recipes/decision-map.md"
    return {
        f"{name}{part}": Table(page=page, commands=commands, output=output, extract=nth_table(index))
        for index, part in enumerate(("", "-auto-steps", "-paired"))
    }


#: The study's data tables, by the report file that holds them, in the file's order.
STUDY_TABLES = {
    "summary.md": ("when-it-pays", "when-it-pays-verdict"),
    "round-two.md": ("when-it-pays-round-two", "when-it-pays-cross-kind", "when-it-pays-share", "when-it-pays-loaded"),
}

TABLES: dict[str, Table] = {
    **_map_tables("decision-map", _MAP, "results.md"),
    **_map_tables("decision-map-fresh", _MAP_FRESH, "results-fresh.md"),
    "policy-dev": Table(
        page="docs/recipes/decision-map.md",
        commands=_policy_dev("model", ("1", "2"), "policy-dev.md"),
        output="policy-dev.md",
    ),
    "policy-dev-copy": Table(
        page="docs/recipes/decision-map.md",
        commands=_policy_dev("copy", ("1", "2"), "policy-dev-copy.md"),
        output="policy-dev-copy.md",
    ),
    "policy-heldout": Table(
        page="docs/recipes/decision-map.md", commands=_policy_heldout(), output="policy-heldout.md"
    ),
    "policy-heldout-seeds": Table(
        page="docs/recipes/decision-map.md",
        commands=_policy_heldout(view="--per_seed", output="policy-heldout-seeds.md"),
        output="policy-heldout-seeds.md",
    ),
    "policy-heldout2": Table(
        page="docs/recipes/decision-map.md",
        commands=_fresh_untied_heldout("--validation", "policy-heldout2.md"),
        output="policy-heldout2.md",
    ),
    "policy-heldout2-seeds": Table(
        page="docs/recipes/decision-map.md",
        commands=_fresh_untied_heldout("--per_seed", "policy-heldout2-seeds.md"),
        output="policy-heldout2-seeds.md",
    ),
    "policy-heldout2-gpu-check": Table(
        page="docs/recipes/decision-map.md",
        commands=_gpu_maps(_GPU_CHECK, "policy-heldout2-gpu-check.md"),
        output="policy-heldout2-gpu-check.md",
    ),
    "policy-dev-wider": Table(
        page="docs/recipes/decision-map.md",
        commands=_gpu_maps(_GPU_DEV, "policy-dev-wider.md"),
        output="policy-dev-wider.md",
    ),
    "tie-then-untie": Table(
        page="docs/recipes/decision-map.md", commands=_tie_then_untie(), output="tie-then-untie.md"
    ),
    # One command, three tables (it runs once). Its runs use portable kernels (untie_recipes.kernels), and
    # scripts/kernel_paths.py showed the numbers the same on every kernel path it tried on one machine
    # (docs/data/kernel-paths.json); yet an Intel Xeon gave other numbers than the AMD EPYC they were made on (CI,
    # 2026-11-28: one seed's chaotic trajectory), so the numbers and the verdicts are exact on a CPU kind only. CI
    # compares the third: which claims the quick preset checks, the same on both kinds.
    "exor-quick": Table(page="docs/recipes/exor.md", commands=_EXOR_QUICK, output="results.md", cost="cpu-kind"),
    "exor-quick-claims": Table(
        page="docs/recipes/exor.md", commands=_EXOR_QUICK, output="results.md", extract=nth_table(1), cost="cpu-kind"
    ),
    "exor-quick-checked": Table(
        page="docs/recipes/exor.md", commands=_EXOR_QUICK, output="results.md", extract=claims_checked, cost="cheap"
    ),
    # The kernel-path check of the quick start's tables: per path, whether each table is what the first path gives,
    # and the claims' verdicts (the first command runs the preset four times: about 16 min on 2 cores). The record's
    # exor-quick-checked entry comes from another CPU kind (`kernel_paths.py exor-quick-checked --write` there, as the
    # page says), so that tests/test_kernel_paths.py compares two kinds: these commands do not rewrite it.
    "exor-kernel-paths": Table(
        page="docs/recipes/exor.md",
        commands=(
            ("python", "scripts/kernel_paths.py", "exor-quick", "exor-quick-claims", "--write"),
            ("python", "scripts/kernel_paths.py", "--summary", "--output", "{out}/kernel-paths.md"),
        ),
        output="kernel-paths.md",
    ),
    "bookcorpus-quick": Table(
        page="docs/recipes/bookcorpus.md",
        commands=(("python", "recipes/bookcorpus.py", "--output_dir", "{out}", "--disable_tqdm"),),
        output="results.md",
        extract=without_columns("tokens/s", "vs tied"),
    ),
    "bookcorpus-clm-seeds": Table(
        page="docs/recipes/bookcorpus.md",
        commands=(
            *(_clm_seed(seed) for seed in (42, 43, 44)),
            ("python", "scripts/bookcorpus_seeds.py", "{out}/clm400-42", "{out}/clm400-43", "{out}/clm400-44"),
        ),
        output=None,
    ),
    "exor-gap-levels": Table(
        page="docs/guides/trigger.md",
        commands=(
            _exor(*"--arms tied --variants main ydh ndh --max_steps 4000 --output_dir {out}/exor-4k-tied".split()),
            ("python", "scripts/trigger_table.py", "{out}/exor-4k-tied", "--gaps_after", "400"),
        ),
        output=None,
    ),
    "exor-trigger": Table(
        page="docs/guides/trigger.md",
        commands=(
            *_TRIGGER_RUNS,
            ("python", "scripts/trigger_table.py", *(c[-2] for c in _TRIGGER_RUNS)),
        ),
        output=None,
    ),
    # Where the quick preset's tied claim fails: the Mixer's shared (0,1) over five schedules (about 10 min on 2 cores).
    "exor-mixer-tied-schedules": Table(
        page="docs/recipes/exor.md",
        commands=(
            *_MIXER_TIED_SCHEDULES,
            ("python", "scripts/geometry_table.py", *(c[-2] for c in _MIXER_TIED_SCHEDULES)),
        ),
        output=None,
    ),
    # The quick start's tied claim restated relative and judged on seeds 43-45 (issue 69), pre-registered: it failed.
    "exor-tied-claim-verdict": Table(
        page="docs/recipes/exor.md",
        commands=(
            _exor("--arms", "untied", "tied", "--seeds", "43", "44", "45", "--output_dir", "{out}/exor-judge"),
            ("python", "scripts/judge_tied_claim.py", "{out}/exor-judge", "--write", "{out}/exor-judge/judgement.md"),
        ),
        output="exor-judge/judgement.md",
    ),
    "exor-paper-gap-rule": Table(
        page="docs/guides/trigger.md",
        commands=(_exor("--preset", "paper", "--untie_when", "gap"),),
        output="results.md",
        cost="record",
    ),
    "measurement-scale": Table(
        page="docs/benchmarks.md",
        commands=(
            (
                "python",
                "benchmarks/measurement_scale.py",
                "--vocabs",
                "32000",
                "128000",
                "256000",
                "--hidden",
                "512",
                "--batch_size",
                "8",
                "--steps",
                "2",
                "--output_dir",
                "{out}",
            ),
        ),  # fmt: skip
        output="results.md",
        cost="timing",
    ),
    "role-rates-cost": Table(
        page="docs/benchmarks.md",
        commands=(("python", "benchmarks/role_rates.py", "--steps", "30", "--repeats", "3", "--output_dir", "{out}"),),
        output="results.md",
        cost="timing",
    ),
    "freshness-cost": Table(
        page="docs/benchmarks.md",
        commands=(("python", "benchmarks/freshness_cost.py", "--output_dir", "{out}"),),
        output="results.md",
        cost="timing",
    ),
    # The "before" table is the same command run with the library of the commit its page names (the check scored up
    # to 4,096 positions at each of 13 temperatures).
    **{
        name: Table(
            page="docs/benchmarks.md",
            commands=(("python", "benchmarks/first_step_cost.py", "--output_dir", "{out}"),),
            output="results.md",
            cost=cost,
        )
        for name, cost in (("first-step-cost", "timing"), ("first-step-cost-before", "record"))
    },
    "untie-latency": Table(
        page="docs/benchmarks.md",
        commands=(("python", "benchmarks/untie_latency.py", "--repeats", "3", "--output_dir", "{out}"),),
        output="results.md",
        cost="timing",
    ),
    "fsdp2-emulation-cost": Table(
        page="docs/benchmarks.md",
        commands=(
            (
                "python",
                "benchmarks/fsdp2_emulation_cost.py",
                "--ranks",
                "2",
                "--steps",
                "20",
                "--repeats",
                "1",
                "--output_dir",
                "{out}",
            ),
        ),  # fmt: skip
        output="results.md",
        cost="timing",
    ),
    # Run from the deepspeed extra's environment (its `python`); the "before" table is the same command run with the
    # library of the commit its page names, whose measuring step kept the tied gradient in a V x d buffer.
    **{
        name: Table(
            page="docs/benchmarks.md",
            commands=(_DEEPSPEED_MEMORY,),
            output="results.md",
            cost=cost,
        )
        for name, cost in (
            ("deepspeed-measurement-memory", "timing"),
            ("deepspeed-measurement-memory-before", "record"),
        )
    },
    # Deterministic on one thread, exact on the CPU kind its page names (a minute on 2 cores).
    "route-table": Table(
        page="docs/guides/tied-checkpoints.md",
        commands=(("python", "scripts/route_table.py", "--output_dir", "{out}"),),
        output="results.md",
        cost="cpu-kind",
    ),
    "example-times": Table(
        page="docs/guides/fine-tuning.md",
        commands=(("python", "benchmarks/example_times.py", "--include_quick_start"),),
        output=None,
        cost="timing",
    ),
    # The study's answer, read from its committed records (seconds, nothing trained): the one-screen summary
    # (summary.md) and round two's tables (issue 77, round-two.md: the cells' choices, the float noise between CPU
    # kinds, the default by embedding share, the loaded-model rule). A commit that adds a record regenerates them
    # (`--write when-it-pays ...`), and CI checks that it did.
    **{
        name: Table(
            page="docs/recipes/when-it-pays.md",
            commands=(("python", "recipes/study.py", "--report_only", "--output_dir", "{out}"),),
            output=output,
            extract=nth_table(index),
            cost="data",
        )
        for output, names in STUDY_TABLES.items()
        for index, name in enumerate(names)
    },
    # The same report's share bands, where the library reads them (the default for a model built fresh, policy
    # "by-share"): a commit that adds a record regenerates them with the tables above.
    "library-share-bands": Table(
        page="untie/decision/share_bands.py",
        commands=(("python", "recipes/study.py", "--report_only", "--output_dir", "{out}"),),
        output="round-two.md",
        extract=nth_table(len(STUDY_TABLES["round-two.md"])),
        cost="data",
    ),
    # ... and, after it, where the default trigger would have fired in each cell's tied runs (item 5's statement).
    "when-it-pays-trigger": Table(
        page="docs/recipes/when-it-pays.md",
        commands=(("python", "recipes/study.py", "--report_only", "--output_dir", "{out}"),),
        output="round-two.md",
        extract=nth_table(len(STUDY_TABLES["round-two.md"]) + 1),
        cost="data",
    ),
}


COSTS = {
    "cheap": "cheap: CI checks it",
    "cpu-kind": "exact on the CPU kind its page names: checked on demand there, --check NAME",
    "expensive": "expensive: checked on demand, --check NAME",
    "timing": "a measurement: --write regenerates it",
    "record": "a record of the commit its page names: neither checked nor written",
    "data": "read from committed records: CI checks it; a commit adding records regenerates it",
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- table: {name} -->", f"<!-- end table: {name} -->"


def committed(name: str) -> str:
    """The table as its page holds it now."""
    table = TABLES[name]
    text = (ROOT / table.page).read_text()
    start, end = _markers(name)
    match = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), text, flags=re.S)
    if match is None:
        raise SystemExit(f"{table.page} has no '{start}' ... '{end}' block for the table {name}.")
    return match.group(1)


#: What each set of commands wrote, within one invocation: tables read from the same report run it once.
_OUTPUTS: dict[tuple, str] = {}


def generate(name: str, finished: Path | None = None) -> str:
    """Run the table's commands in a fresh folder and return the table they write; with `finished`, the folder of a
    run of those commands that already ended (an expensive table run in sittings), read its output instead."""
    table = TABLES[name]
    if finished is not None:
        if table.output is None:
            raise SystemExit(f"[{name}] its table is its command's standard output: --from cannot read it.")
        return table.extract((finished / table.output).read_text()).strip()
    key = (table.commands, table.output)
    if key not in _OUTPUTS:
        _OUTPUTS[key] = _run_commands(name)
    return table.extract(_OUTPUTS[key]).strip()


def _run_commands(name: str) -> str:
    """Run the table's commands in a fresh folder; the text of the file (or standard output) the last one writes."""
    table = TABLES[name]
    with tempfile.TemporaryDirectory(prefix=f"docs-table-{name}-") as out:
        stdout = ""
        for number, parts in enumerate(table.commands, 1):
            command = [sys.executable if part == "python" else part.replace("{out}", out) for part in parts]
            print(f"[{name} {number}/{len(table.commands)}] {' '.join(command)}", flush=True)
            last = number == len(table.commands)
            done = subprocess.run(
                command, cwd=ROOT, check=True, text=True,
                stdout=subprocess.PIPE if last and table.output is None else subprocess.DEVNULL,
            )  # fmt: skip
            stdout = done.stdout or ""
        return stdout if table.output is None else Path(out, table.output).read_text()


def last_commit(name: str) -> str:
    """The commit that last changed the table's block in its page ("uncommitted" when the page's block differs from
    HEAD's, "unknown" without git)."""
    table = TABLES[name]
    start, end = _markers(name)
    try:
        log = subprocess.run(
            ["git", "log", "-1", "--format=%h", "-L", f"/{start}/,/{end}/:{table.page}"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", table.page], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    commit = log.strip().splitlines()[0] if log.strip() else "unknown"
    return f"{commit} (the page has uncommitted changes)" if dirty else commit


def write(name: str, new: str) -> None:
    table = TABLES[name]
    path = ROOT / table.page
    start, end = _markers(name)
    text = path.read_text()
    committed(name)  # the markers must be there
    text = re.sub(re.escape(start) + r"\n.*?\n" + re.escape(end), lambda _: f"{start}\n{new}\n{end}", text, flags=re.S)
    path.write_text(text)
    print(f"[{name}] written into {table.page}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="run the commands and replace the tables in their pages")
    mode.add_argument("--check", action="store_true", help="run the commands; exit 1 if a page's table differs")
    mode.add_argument("--list", action="store_true", help="list the tables: page, cost, commands, last commit")
    parser.add_argument("--cheap", action="store_true", help="only the tables cheap enough for CI")
    parser.add_argument(
        "--from", dest="finished", type=Path, metavar="DIR",
        help="read the tables from DIR, where the named tables' commands already ran (with --output_dir DIR)",
    )  # fmt: skip
    parser.add_argument("names", nargs="*", help=f"tables to process (default: all): {', '.join(TABLES)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(TABLES))
    if unknown:
        parser.error(f"unknown table(s) {unknown}; choose among {sorted(TABLES)}")
    names = [n for n in (args.names or TABLES) if TABLES[n].cost == "cheap" or not args.cheap]
    if args.finished is not None and not args.names:
        parser.error("--from reads one run's output: name the tables its commands wrote")
    if args.list:
        for name in names:
            table = TABLES[name]
            commands = "".join(f"\n  {line}" for line in table.shell())
            print(f"{name}: {table.page} ({COSTS[table.cost]}; last written in {last_commit(name)}){commands}")
        return 0
    stale = []
    for name in names:
        if TABLES[name].cost == "record" or (args.check and TABLES[name].cost == "timing"):
            print(f"[{name}] {COSTS[TABLES[name].cost]}")
            continue
        new = generate(name, args.finished)
        if args.write:
            write(name, new)
        elif new != committed(name).strip():
            stale.append(name)
            print(f"[{name}] {TABLES[name].page} differs from what its command writes now:\n{new}", file=sys.stderr)
        else:
            print(f"[{name}] {TABLES[name].page}: up to date")
    if stale:
        print(
            f"Stale tables: {', '.join(stale)}. Regenerate them in this change: python scripts/docs_tables.py --write "
            + " ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
