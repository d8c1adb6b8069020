"""One run of the study: its setup, its schedule, what it measures while it trains (the validation curve, the train
loss curve, the trigger), and its record.

The step loop, the evaluation, the data order and the checkpoints are the decision map's
(`untie_recipes.tasks.decision_map.training`): step t reads the t-th slice of a permutation drawn from the seed, no
dropout, so a run depends on its seed and its step only and a branch at step s is the tied run to s, then a live untie.
What the study adds is the schedule (warm-up, constant, linear cooldown over the last 20% of the run's own budget)
and a recorder that keeps a curve and can be resumed exactly (`CurveRecorder`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from untie_recipes.tasks.decision_map.training import Recorder, TrainingSetup, data_order, save_checkpoint
from untie_recipes.tasks.study.protocol import Arm, arm_spec, lr_factor, untie_step

#: The clock a time limit reads (`out_of_time`); a test replaces it with one that ticks per call.
CLOCK = time.monotonic
#: Epoch e > 0 of a seed's data order is the permutation drawn from seed + EPOCH_STRIDE * e.
EPOCH_STRIDE = 1_000_003


def out_of_time(stop_at: float | None) -> bool:
    """Whether a time limit (a `CLOCK()` value; None: no limit) has passed."""
    return stop_at is not None and CLOCK() > stop_at


def study_order(n_blocks: int, seed: int, blocks_needed: int) -> torch.Tensor:
    """The decision map's permutation of the blocks for the seed (`data_order`); where a budget needs more blocks than
    the corpus has (the device tier's larger cells), further permutations follow, one per epoch, each drawn from the
    seed and the epoch. One epoch (every CPU cell) is exactly the decision map's order."""
    parts = [data_order(n_blocks, seed)]
    while len(parts) * n_blocks < blocks_needed:
        parts.append(data_order(n_blocks, seed + EPOCH_STRIDE * len(parts)))
    return torch.cat(parts)


@dataclass(frozen=True)
class RunSpec:
    """One run: a cell's arm at a seed and a learning rate, over `budget` steps of its own schedule ("sweep" runs
    are the half-budget LR sweep's, "arm" runs the study's)."""

    cell: str
    arm: str
    setup: TrainingSetup
    budget: int
    kind: str = "arm"

    @property
    def spec(self) -> Arm:
        return arm_spec(self.arm)

    @property
    def name(self) -> str:
        if self.kind == "sweep":
            return f"{self.cell}-sweep-{self.arm}-lr{self.setup.learning_rate:g}-s{self.setup.seed}"
        return f"{self.cell}-s{self.setup.seed}-{self.spec.file_name}"

    @property
    def branch_step(self) -> int | None:
        """The tied run's step this arm branches from (None: it runs from step 0)."""
        fraction = self.spec.fraction
        return None if fraction is None else untie_step(fraction, self.budget)


def build_optimizer(model: torch.nn.Module, setup: TrainingSetup, budget: int):
    """AdamW over every parameter, and the study's schedule (`protocol.lr_factor`) as a `LambdaLR`: a head added by an
    untie joins the shared matrix's group and follows the same curve."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=setup.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: lr_factor(done, budget, setup.warmup))
    return optimizer, scheduler


def curve_steps(budget: int, points: int) -> list[int]:
    """The steps the validation curve is read at: `points` evenly spaced, the last at `budget`."""
    return sorted({max(1, round(i * budget / points)) for i in range(1, points + 1)})


def curve_subset(validation: torch.Tensor, blocks: int) -> torch.Tensor:
    """`blocks` validation blocks evenly spaced over the split (every source is represented): the curve's
    evaluations read these, the final loss reads them all."""
    n = len(validation)
    if blocks <= 0 or blocks >= n:
        return validation
    return validation[torch.arange(blocks) * n // blocks]


class OutOfTime(Exception):
    """A run stopped at its time limit after saving its resume checkpoint (the device tier's calls)."""


class CurveRecorder(Recorder):
    """The decision map's recorder (evaluations at the curve's steps, checkpoints, progress) that also keeps the train
    loss curve (the mean over each interval between curve points), the trigger watch's state and the wall seconds
    in what a checkpoint saves, so that a resumed run writes the record an uninterrupted one writes. `stop_at`: a
    `CLOCK()` value past which the run saves `resume` and raises `OutOfTime`."""

    def __init__(self, model, optimizer, scheduler, validation, steps, checkpoints, progress,
                 resume: Path | None = None, stop_at: float | None = None) -> None:  # fmt: skip
        super().__init__(model, optimizer, scheduler, validation, steps, checkpoints, progress)
        self.train: dict[str, float] = {}
        self.interval: list[float] = [0.0, 0.0]
        self.watch = None
        self.resume, self.stop_at = resume, stop_at
        self.seconds_before, self.started = 0.0, time.perf_counter()
        self.cpu_before, self.cpu_started = 0.0, time.process_time()

    def __call__(self, step: int, loss: float) -> None:
        self.interval = [self.interval[0] + loss, self.interval[1] + 1]
        if step in self.budgets:
            self.train[str(step)] = self.interval[0] / self.interval[1]
            self.interval = [0.0, 0.0]
        super().__call__(step, loss)
        if out_of_time(self.stop_at) and self.resume is not None:
            save_checkpoint(self.resume, step, self.model, self.optimizer, self.scheduler, self.measured)
            raise OutOfTime(step)

    @property
    def seconds(self) -> float:
        """Wall seconds of the run so far (over every sitting)."""
        return self.seconds_before + time.perf_counter() - self.started

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of this process spent on the run so far (over every sitting): its core-hours on a machine
        shared with other jobs, where wall time overstates them."""
        return self.cpu_before + time.process_time() - self.cpu_started

    @property
    def measured(self) -> dict:
        out = {**super().measured, "train": dict(self.train), "interval": list(self.interval),
               "recent": list(self.recent), "seconds": self.seconds, "cpu_seconds": self.cpu_seconds}  # fmt: skip
        if self.watch is not None:
            out["watch"] = self.watch.state_dict()
        return out

    def resume_from(self, measured: dict, seconds: bool = True) -> None:
        """Continue from a checkpoint's measurements; `seconds` False starts the clock at 0 (a branch counts only
        its own time)."""
        super().resume_from(measured)
        self.train = dict(measured.get("train", {}))
        self.interval = list(measured.get("interval", [0.0, 0.0]))
        self.recent = list(measured.get("recent", []))
        self.seconds_before = measured.get("seconds", 0.0) if seconds else 0.0
        self.cpu_before = measured.get("cpu_seconds", 0.0) if seconds else 0.0
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        if self.watch is not None and "watch" in measured:
            self.watch.load_state_dict(measured["watch"])


class JsonRecord:
    """A dataclass record kept as one JSON file: saved whole or not at all, loaded back field by field."""

    def save(self, path: Path) -> None:
        """Written to a partial file and renamed: a killed save leaves no half record."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self), indent=1) + "\n")  # type: ignore[call-overload]
        partial.replace(path)

    @classmethod
    def load(cls: type[RecordType], path: Path) -> RecordType:
        return cls(**json.loads(path.read_text()))


RecordType = TypeVar("RecordType", bound=JsonRecord)


@dataclass
class StudyRecord(JsonRecord):
    """One finished run: what it trained, what it measured, where it ran and on which corpus."""

    name: str
    cell: str
    arm: str
    kind: str
    seed: int
    lr: float
    budget_steps: int
    untie_step: int | None
    head: str | None
    optimizer_state: str
    curve_steps: list[int]
    curve_validation: list[float]
    """Validation loss on the curve's subset of blocks (`curve_subset`) at `curve_steps`."""
    curve_train: list[float]
    final_validation_loss: float
    """On every validation block, at the end of the run."""
    train_loss_tail: float
    steps_run: int
    """The optimizer steps this run computed (a branch: after its branch point)."""
    tokens: int
    """Tokens the arm trained on in all (a branch's tied phase included)."""
    wall_seconds: float
    cpu_seconds: float
    """CPU seconds of the run's process (with one thread: its core-seconds, whatever else the machine ran)."""
    setup: dict
    params: int
    embedding_params: int
    tokens_per_embedding_row: float
    machine: dict
    corpus_digest: str
    trigger: dict | None = None
    checkpoint_digests: dict[str, str] = field(default_factory=dict)
    epochs: float = 1.0
    """Passes over the training blocks the run's budget needs (above 1: blocks are seen again, `study_order`)."""

    def curve(self) -> list[tuple[int, float]]:
        return list(zip(self.curve_steps, self.curve_validation, strict=True))


Progress = Callable[[int, float], None]
