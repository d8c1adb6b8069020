"""Fine-tuning from the study's own checkpoints (issue 68, item 2; the protocol: docs/recipes/study.md,
"Fine-tuning"): the tied arm's final checkpoint of each development seed of cell A (and of round two's cell C),
fine-tuned on a shifted domain (`untie_recipes.tasks.study.target`) for `FINETUNE_STEPS` steps at a third of the tied
rate, in four arms: stay tied, untie at once (a copy), the live default `untie.Untier`, untie at half; and round two's
two (issue 77): untie at once with the input embedding at 0.1x the rate, or frozen. Each arm's record keeps the target
loss and the source loss (the pretraining validation split: what was forgotten) before and after."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from untie import Untier, untie_embeddings
from untie.registry import Registry
from untie.structure.role_rates import RoleRates
from untie_recipes.tasks.decision_map.corpus import BLOCK, TokenizedCorpus
from untie_recipes.tasks.decision_map.training import evaluate, train_steps
from untie_recipes.tasks.study.model import build_model
from untie_recipes.tasks.study.protocol import untie_step
from untie_recipes.tasks.study.provenance import blocks_digest, repeat_refusal
from untie_recipes.tasks.study.runs import StudyContext
from untie_recipes.tasks.study.training import (
    JsonRecord,
    Progress,
    RunSpec,
    StudyRecord,
    build_optimizer,
    study_order,
)

logger = logging.getLogger(__name__)

#: The cells whose tied checkpoints are fine-tuned: round one's A, and round two's C (issue 77, item 3).
FINETUNE_CELLS = ("A", "C")
FINETUNE_STEPS = 300
FINETUNE_WARMUP = 30
#: The fine-tuning rate is the tied arm's divided by this.
LR_DIVISOR = 3.0
#: Round one's arms: the fine-tuning table's complete seeds are those that have all of them.
FINETUNE_ARMS = ("stay-tied", "untie-now", "default", "untie@1/2")
#: Round two's arms (the forgetting knob): untie at once, the head a copy, the input embedding at this multiple of the
#: rate (0: frozen), through the library's per-role groups (`UntieConfig.embedding_lr_scale`).
SCALED_FINETUNE = {"untie-now-emb0.1": 0.1, "untie-now-frozen": 0.0}
ALL_FINETUNE_ARMS = FINETUNE_ARMS + tuple(SCALED_FINETUNE)
#: The folder under the records of each CPU kind's own fine-tuning table (`--finetune_here`).
KINDS = "kinds"
#: The step `untie@1/2` unties at (the library's rounding of 0.5 of the steps).
HALF_STEP = untie_step(0.5, FINETUNE_STEPS)
#: How far the loaded checkpoint's source loss may be from its tied record's final validation loss.
CHECKPOINT_TOLERANCE = 1e-6


@dataclass
class FineTuneRecord(JsonRecord):
    """One fine-tuning run: its arm and seed, where it started from, and its losses before and after."""

    name: str
    cell: str
    arm: str
    seed: int
    lr: float
    steps: int
    batch_size: int
    untie_step: int | None
    untie_reason: str | None
    pretrained_run: str
    target_before: float
    source_before: float
    target_loss: float
    """On every validation block of the target, after fine-tuning."""
    source_loss: float
    """On every validation block of the pretraining corpus, after fine-tuning."""
    train_loss_tail: float
    wall_seconds: float
    cpu_seconds: float
    machine: dict
    corpus_digest: str
    target_digest: str
    epochs: float

    def matches(self, expected: dict) -> bool:
        """Whether the record was made with these settings (learning rate, steps, batch, checkpoint, corpus, target)."""
        return all(getattr(self, name) == value for name, value in expected.items())


def finetune_name(cell: str, seed: int, arm: str) -> str:
    """The record's name: the cell, the seed and the arm (a "/" written "of")."""
    return f"{cell}-ft-s{seed}-{arm.replace('/', 'of')}"


def load_finetune_records(folder: Path) -> list[FineTuneRecord]:
    """Every fine-tuning record in `folder` (none where it does not exist)."""
    return [FineTuneRecord.load(path) for path in sorted(folder.glob("*.json"))]


def load_kinds_finetune_records(records: Path) -> list[FineTuneRecord]:
    """Each CPU kind's own fine-tuning records under a records folder (``kinds/<kind>/finetune/``, `--finetune_here`):
    read by round two's loaded-model table only, never by a pretraining group's."""
    return [r for folder in sorted(records.glob(f"{KINDS}/*/finetune")) for r in load_finetune_records(folder)]


class _AfterStep:
    """`after_step` for `train_steps`: the arm's hooks, the progress line and the training loss's tail."""

    def __init__(self, progress: Progress, hooks: list[Callable[[int], object]]) -> None:
        self.progress, self.hooks = progress, hooks
        self.recent: list[float] = []

    def __call__(self, step: int, loss: float) -> None:
        for hook in self.hooks:
            hook(step)
        self.recent = [*self.recent[-49:], loss]
        self.progress(1, loss)


def pretrained_state(ctx: StudyContext, tied: RunSpec, record: StudyRecord,
                     retrain: Callable[[], object]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The weights of the tied run's final checkpoint, checked: the model they make must give the tied record's final
    validation loss. Where the checkpoint is gone, `retrain()` trains the tied run again (it saves the checkpoint)."""
    path = ctx.checkpoint_path(tied, "final")
    if not path.exists():
        refusal = repeat_refusal(record.machine, ctx.machine, tied.name)
        if refusal is not None:
            raise RuntimeError(f"study: {path} is gone, and {refusal}")
        logger.warning("study: %s is gone; training %s again for the fine-tuning.", path, tied.name)
        retrain()
    state = torch.load(path, map_location=ctx.device, weights_only=True)["model"]
    model = _model(ctx, tied.cell, tied.setup.seed, state)
    loss = evaluate(model, ctx.corpus.validation)
    if abs(loss - record.final_validation_loss) > CHECKPOINT_TOLERANCE:
        committed = ctx.committed_folder / ctx.record_path(tied).name if ctx.committed_folder else None
        raise RuntimeError(
            f"{path} gives a validation loss of {loss:.6f}, its record {tied.name} {record.final_validation_loss:.6f} "
            f"(made on {record.machine.get('cpu')}, kernels {record.machine.get('kernel_path')}; here: "
            f"{ctx.machine.get('cpu')}, kernels {ctx.machine.get('kernel_path')}): it is not that run's final "
            f"checkpoint. Another CPU kind trains other weights: fine-tune on the record's kind, or start a study of "
            f"this machine's own (another --output_dir, --records_dir ''). Otherwise delete {path.parent}, "
            f"{ctx.record_path(tied)}"
            + (f" and its committed copy {committed}" if committed else "")
            + ", then run the study again."
        )
    return state


def _model(ctx: StudyContext, cell: str, seed: int, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The cell's tied model of the seed, with the checkpoint's weights."""
    shape_setup = ctx.setup(cell, seed, 0.0)
    eos = ctx.corpus.tokenizer.eos_token_id or 0
    model = build_model(shape_setup.width, shape_setup.layers, seed, ctx.vocab, BLOCK, None, eos)
    model.load_state_dict(state)
    return model.to(ctx.device)


def finetune_run(ctx: StudyContext, target: TokenizedCorpus, cell: str, seed: int, arm: str, state: dict, lr: float,
                 pretrained: str, progress: Progress) -> FineTuneRecord:  # fmt: skip
    """One arm of one seed: the loaded tied model fine-tuned on the target for `FINETUNE_STEPS` steps, at the
    pretraining rate `lr` divided by `LR_DIVISOR`."""
    model = _model(ctx, cell, seed, state)
    target_before, source_before = evaluate(model, target.validation), evaluate(model, ctx.corpus.validation)
    setup = dataclasses.replace(ctx.setup(cell, seed, lr / LR_DIVISOR), warmup=FINETUNE_WARMUP)
    # The registered default for a loaded tied model (the trigger, or the deadline at 30%), pinned by policy="off" so
    # that the arm keeps its meaning whatever the library's default becomes (the same run for trained weights: seed
    # 1's arm, run again pinned, repeated its record exactly; docs/recipes/study.md, "Fine-tuning").
    untier = (Untier(model, max_steps=FINETUNE_STEPS, tokenizer=ctx.corpus.tokenizer, policy="off")
              if arm == "default" else None)  # fmt: skip
    optimizer, scheduler = build_optimizer(model, setup, FINETUNE_STEPS)
    hooks: list[Callable[[int], object]] = []
    installed = Registry("study: per-role rates")  # the role groups' pre-hook, taken off once the arm has trained
    if arm == "untie-now":
        untie_embeddings(model, optimizer)
    elif arm in SCALED_FINETUNE:  # untie-now, then the input embedding in a group of its own at the scale
        untie_embeddings(model, optimizer)
        rates = RoleRates({"input_embedding": SCALED_FINETUNE[arm], "head": 1.0}, False, "study")
        rates.split(optimizer, model, installed, scheduler)
    elif arm == "untie@1/2":
        hooks.append(lambda step: untie_embeddings(model, optimizer) if step == HALF_STEP else None)
    elif untier is not None:
        untier.start(optimizer)
        hooks.append(lambda step: untier.step())
    elif arm != "stay-tied":
        raise ValueError(f"fine-tuning arm {arm!r}: choose among {ALL_FINETUNE_ARMS}.")
    after = _AfterStep(progress, hooks)
    order = study_order(len(target.train), seed, FINETUNE_STEPS * ctx.batch_size)
    started, cpu_started = time.perf_counter(), time.process_time()
    train_steps(model, optimizer, scheduler, setup, target.train, order, 0, FINETUNE_STEPS, after)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    installed.close()
    fixed = {"untie-now": 0, "untie@1/2": HALF_STEP, **dict.fromkeys(SCALED_FINETUNE, 0)}
    untied_at, reason = (fixed[arm], "fixed") if arm in fixed else (None, None)
    if untier is not None:
        untied_at, reason = untier.untie_step, untier.untie_reason
        untier.close()
    return FineTuneRecord(
        name=finetune_name(cell, seed, arm), cell=cell, arm=arm, seed=seed, lr=setup.learning_rate,
        steps=FINETUNE_STEPS, batch_size=ctx.batch_size, untie_step=untied_at, untie_reason=reason,
        pretrained_run=pretrained, target_before=target_before, source_before=source_before,
        target_loss=evaluate(model, target.validation), source_loss=evaluate(model, ctx.corpus.validation),
        train_loss_tail=sum(after.recent) / max(1, len(after.recent)), wall_seconds=round(seconds, 1),
        cpu_seconds=round(cpu_seconds, 1), machine=dict(ctx.machine), corpus_digest=ctx.corpus_digest,
        target_digest=blocks_digest(target), epochs=FINETUNE_STEPS * ctx.batch_size / len(target.train),
    )  # fmt: skip


def run_finetune(ctx: StudyContext, target: TokenizedCorpus, seed: int, tied: RunSpec, record: StudyRecord,
                 retrain: Callable[[], object], progress: Progress) -> list[FineTuneRecord]:  # fmt: skip
    """Every fine-tuning arm of one seed, each recorded under ``<output_dir>/records/finetune`` (and copied to the
    committed folder) and skipped by a rerun when its record was made with the same settings, checkpoint, corpus and
    target (else run again, with a warning)."""
    folder = ctx.records_folder / "finetune"
    expected = {"lr": record.lr / LR_DIVISOR, "steps": FINETUNE_STEPS, "batch_size": ctx.batch_size,
                "pretrained_run": tied.name, "corpus_digest": ctx.corpus_digest,
                "target_digest": blocks_digest(target)}  # fmt: skip
    out: list[FineTuneRecord] = []
    state = None
    for arm in ALL_FINETUNE_ARMS:
        path = folder / f"{finetune_name(tied.cell, seed, arm)}.json"
        if path.exists():
            found = FineTuneRecord.load(path)
            if found.matches(expected):
                out.append(found)
                progress(FINETUNE_STEPS, float("nan"))
                continue
            logger.warning("study: %s was made with other settings, corpus or target; running it again.", path)
        if state is None:
            state = pretrained_state(ctx, tied, record, retrain)
        done = finetune_run(ctx, target, tied.cell, seed, arm, state, record.lr, tied.name, progress)
        logger.info("study: %s done (target %.4f, source %.4f)", done.name, done.target_loss, done.source_loss)
        done.save(path)
        ctx.commit(path, "finetune")
        out.append(done)
    return out
