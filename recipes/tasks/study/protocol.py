"""The study's protocol, fixed before any run: the cells, the arms, the budget, the schedule, the seeds.

Everything here is a constant or a pure function of them, so the recipe, the device tier and the report read one
definition. The numbers follow issue 68: two cells on the decision map's corpus (an 8,192 BPE vocabulary, blocks of
128 tokens), a budget in tokens per parameter of the tied model, a linear warm-up, a constant learning rate and a
linear cooldown to 0 over the last 20% of the budget, three development seeds, and three held-out seeds of cell A
that no development command may run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from untie.decision.triggers import resolve_step

#: The share of a run's budget that its linear cooldown to 0 covers (the last 20%).
COOLDOWN = 0.2
#: Development seeds (the default); the LR sweep runs on the first.
DEVELOPMENT_SEEDS = (1, 2, 3)
#: Seeds reserved for an independent held-out evaluation of cell A: refused unless ``--held_out`` is given.
HELD_OUT_SEEDS = (31, 32, 33)
#: The sweep's values around a cell's centre: a factor of 2 apart.
SWEEP_FACTOR = 2.0


@dataclass(frozen=True)
class Cell:
    """One cell of the study: a Llama-style decoder's shape, its token budget and its arms."""

    name: str
    width: int
    layers: int
    tokens_per_parameter: float
    lr_centre: float
    """The middle of the LR sweep (the decision map's rate for the width), fixed before any run."""
    arms: tuple[str, ...]
    round_two: tuple[str, ...] = ()
    """Round two's arms beyond round one's (issue 77), run with ``--round_two``; the embedding-scale arm joins them
    once its sweep has chosen k (`scale_sweep`)."""
    scale_sweep: bool = False
    """Round two sweeps the input embedding's scale in this cell (`SCALE_SWEEP`)."""

    def sweep_values(self) -> tuple[float, ...]:
        """The sweep's three learning rates, a factor of `SWEEP_FACTOR` apart around `lr_centre`."""
        return (self.lr_centre / SWEEP_FACTOR, self.lr_centre, self.lr_centre * SWEEP_FACTOR)


@dataclass(frozen=True)
class Arm:
    """How an arm trains: untied from step 0 (its head `head`: "drawn" by the model's initialiser or a "copy" of the
    embedding), or tied and untied at `fraction` of the budget (branched from the tied run) with the head's
    optimizer state `optimizer_state`; tied throughout when neither is set."""

    name: str
    head: str | None = None
    fraction: float | None = None
    optimizer_state: str = "copy"
    embedding_scale: float = 1.0
    """The input embedding's learning rate as a multiple of the arm's rate (`UntieConfig.embedding_lr_scale`): round
    two's `untied-emb<k>` arms (issue 77)."""

    @property
    def tied_phase(self) -> bool:
        """Whether the arm starts tied (tied, and every branch): it trains at the tied arm's learning rate."""
        return self.head is None

    @property
    def plain(self) -> str:
        """Whose swept learning rate the arm uses: "tied" for the tied-phase arms (kept after the untie), "untied" for
        the arms untied from step 0."""
        return "tied" if self.tied_phase else "untied"

    @property
    def file_name(self) -> str:
        return self.name.replace("/", "of")


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("tied"),
        Arm("untied", head="drawn"),
        Arm("copy0", head="copy"),
        Arm("untie@1/3", fraction=1 / 3),
        Arm("untie@2/3", fraction=2 / 3),
        Arm("untie@2/3-fresh", fraction=2 / 3, optimizer_state="reset"),
        Arm("untie@0.8", fraction=1 - COOLDOWN),
        Arm("untie@0.95", fraction=0.95),
        Arm("untie@0.9", fraction=0.9),
    )
}
#: Round two's arm prefix (issue 77): untied from step 0, head drawn, the input embedding at k x the untied rate.
SCALED_ARM = "untied-emb"
#: The embedding-scale sweep's first values (k = 1 is the untied arm itself); an edge extends by `SCALE_FACTOR`.
SCALE_SWEEP = (1.0, 4.0, 16.0)
SCALE_FACTOR = 4.0


def scaled_arm(scale: float) -> str:
    """The name of the arm untied from step 0 with the input embedding at `scale` x the rate. At 1 it trains as
    `untied` does; the scale sweep runs it under this name so that every k of the sweep is run on one machine (records
    of other CPU kinds are never compared: docs/recipes/study.md, "Pooling")."""
    return f"{SCALED_ARM}{scale:g}"


def arm_spec(name: str) -> Arm:
    """The arm called `name`: one of `ARMS`, or a round-two `untied-emb<k>` arm."""
    if name in ARMS:
        return ARMS[name]
    if name.startswith(SCALED_ARM):
        return Arm(name, head="drawn", embedding_scale=float(name[len(SCALED_ARM) :]))
    raise KeyError(f"no study arm {name!r}")


#: Round one's arms (issue 68): what its tables, its rule and its pages read; round two's are in `Cell.round_two`.
ROUND_ONE_ARMS = tuple(name for name in ARMS if name != "untie@0.9")
CELL_A_ARMS = ROUND_ONE_ARMS
#: Cell B leaves out the copy at step 0 and the fresh optimizer state (the budget, as the issue allows).
CELL_B_ARMS = tuple(name for name in ROUND_ONE_ARMS if name not in ("copy0", "untie@2/3-fresh"))

#: Cell C's arms (issue 77, round two): where users train, about 25% of the parameters in the embedding.
CELL_C_ARMS = ("tied", "untied", "untie@1/3", "untie@2/3", "untie@0.9")
#: The CPU tier's cells (issue 68, item 1).
CPU_CELLS = ("A", "B")
#: Round two's CPU cells (issue 77), each on its own vocabulary of the same sources (`CELL_VOCABS`).
SHARE_CELLS = ("C",)
#: The device tier's share ladder (issue 77, item 6): one body, 256 wide and 4 deep, at three BPE vocabularies of the
#: same text: about 25%, 57% and 84% of the parameters in the embedding. The most informative share (4k) comes first.
LADDER_VOCABS = {"L4k": 4096, "L16k": 16384, "L64k": 65536}
LADDER_CELLS = tuple(LADDER_VOCABS)
#: The ladder's arms: tied, untied (drawn), untied with the input embedding at 16 x the rate (the k cell B's sweep
#: chose: docs/recipes/study.md), and a tied phase to 2/3; on 2 development seeds.
LADDER_ARMS = ("tied", "untied", scaled_arm(16.0), "untie@2/3")
LADDER_SEEDS = (1, 2)
#: The BPE vocabulary each round-two cell's corpus is cut with (round one's cells: 8,192).
CELL_VOCABS = {"C": 2048, **LADDER_VOCABS}
#: The device tier's cells (issue 68, item 3): widths 64 x 2, 128 x 4 and 256 x 8 at 4 and 10 tokens per parameter,
#: at a 32,768 vocabulary, every arm; the sweep centred on the decision map's rate for the width.
DEVICE_SHAPES = {64: (2, 3e-3), 128: (4, 2e-3), 256: (8, 1e-3)}
DEVICE_CELLS = tuple(f"D{w}x{DEVICE_SHAPES[w][0]}t{t}" for w in DEVICE_SHAPES for t in (4, 10))

CELLS: dict[str, Cell] = {
    "A": Cell("A", width=64, layers=2, tokens_per_parameter=10.0, lr_centre=3e-3, arms=CELL_A_ARMS),
    "B": Cell(
        "B",
        width=128,
        layers=4,
        tokens_per_parameter=4.0,
        lr_centre=2e-3,
        arms=CELL_B_ARMS,
        round_two=("untie@0.9",),
        scale_sweep=True,
    ),  # fmt: skip
    "C": Cell(
        "C", width=128, layers=4, tokens_per_parameter=4.0, lr_centre=2e-3, arms=CELL_C_ARMS, scale_sweep=False
    ),  # fmt: skip
    **{
        name: Cell(name, width=256, layers=4, tokens_per_parameter=4.0, lr_centre=1e-3, arms=LADDER_ARMS)
        for name in LADDER_CELLS
    },  # fmt: skip
    **{
        f"D{w}x{layers}t{t}": Cell(f"D{w}x{layers}t{t}", w, layers, float(t), lr, CELL_A_ARMS)
        for w, (layers, lr) in DEVICE_SHAPES.items()
        for t in (4, 10)
    },
}


def budget_steps(tokens_per_parameter: float, params: int, batch_size: int, block: int) -> int:
    """The budget in optimizer steps: ceil(tokens_per_parameter * params / (batch_size * block))."""
    return math.ceil(tokens_per_parameter * params / (batch_size * block))


def half_budget(budget: int) -> int:
    """The LR sweep's budget: half the cell's (its cooldown is its own last 20%)."""
    return math.ceil(budget / 2)


def untie_step(fraction: float, budget: int) -> int:
    """The step a branch at `fraction` of a `budget`-step run unties at (the library's rounding)."""
    step = resolve_step(fraction, budget, "untie_at")
    assert step is not None
    return step


def cooldown_start(budget: int) -> int:
    """The first step of the cooldown: the branch at 0.8 unties exactly there."""
    return untie_step(1 - COOLDOWN, budget)


def lr_factor(done: int, budget: int, warmup: int) -> float:
    """The learning-rate multiplier of the optimizer step that follows `done` steps (a `LambdaLR` lambda): a linear
    warm-up over `warmup` steps, 1 until `cooldown_start`, then linear to 0 at `budget`."""
    start = cooldown_start(budget)
    if done >= start:
        return max(0.0, (budget - done) / (budget - start))
    return min(1.0, (done + 1) / max(1, warmup))


def check_seeds(cell: str, seeds: tuple[int, ...], held_out: bool) -> None:
    """Refuse the held-out seeds unless the held-out evaluation asks for them (``--held_out``)."""
    reserved = sorted(set(seeds) & set(HELD_OUT_SEEDS))
    if reserved and not held_out:
        raise SystemExit(
            f"cell {cell}: seeds {reserved} are reserved for the independent held-out evaluation (issue 68): a "
            f"development run must not see them. Use the development seeds {DEVELOPMENT_SEEDS} or others."
        )


def best_value(losses: dict[float, float]) -> float:
    """The learning rate with the lowest final loss (a non-finite loss counts as the worst; a tie: the smaller)."""
    return min(sorted(losses), key=lambda lr: (losses[lr] if math.isfinite(losses[lr]) else math.inf, lr))


def next_sweep_value(losses: dict[float, float], factor: float = SWEEP_FACTOR) -> float | None:
    """The value the sweep extends to when its best (lowest final loss) sits at an edge of the values run: a factor of
    `SWEEP_FACTOR` beyond that edge; None when the best is inside. A diverged run (a non-finite loss) counts as the
    worst."""
    values = sorted(losses)
    best = best_value(losses)
    if len(values) < 2 or values[0] < best < values[-1]:
        return None
    return best / factor if best == values[0] else best * factor
