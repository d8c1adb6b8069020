"""The decision map's runs: small causal LMs trained on the corpus's blocks, each token seen at most once.

Everything a run does depends on its seed and its step only, never on the budget it is evaluated at, so one run
answers several budgets and an arm that unties at step s is the tied run up to s, then a live untie:

* the data order: a permutation of the training blocks drawn from the seed; step t reads its slice;
* the learning rate: a linear warm-up over `warmup` steps, then constant (no decay tied to a budget);
* no dropout, so a run holds no random state besides the order.

A fixed arm is therefore branched from the tied run's checkpoint at its step (`untie.untie_embeddings` with the
optimizer state copied, what `untie.Untier` does at that step; `tests/test_decision_map.py` checks it against a live
`Untier` run to 1e-6). The auto arm is a live run of the default `untie.Untier`, the custom-loop twin of the default
`UntieCallback()`, whose deadline (30% of the run) does depend on the budget: where its trigger has not fired by a
budget's deadline, that budget's auto arm is the branch at the deadline step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers as tf

from untie.checkpoints.saved_state import tensor_digest
from untie.decision.triggers import resolve_step


@dataclass(frozen=True)
class TrainingSetup:
    """What every run of a (width, seed) shares."""

    width: int
    layers: int
    heads: int
    seed: int
    batch_size: int
    learning_rate: float
    warmup: int
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    @property
    def name(self) -> str:
        return f"d{self.width}-s{self.seed}"


def build_model(setup: TrainingSetup, vocab_size: int, block: int, tied: bool, eos: int = 0) -> tf.GPT2LMHeadModel:
    """A GPT-2 of the setup's width and depth, initialised from the seed."""
    torch.manual_seed(setup.seed)
    config = tf.GPT2Config(
        vocab_size=vocab_size, n_positions=block, n_embd=setup.width, n_layer=setup.layers, n_head=setup.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=eos,
        eos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(config)  # untied: the head has its own initialisation, as a user's untied model has


def build_optimizer(model: torch.nn.Module, setup: TrainingSetup):
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=setup.weight_decay)
    warmup = max(1, setup.warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, scheduler


def data_order(n_blocks: int, seed: int) -> torch.Tensor:
    return torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))


def evaluate(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy over every validation block (nats per token)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in blocks.split(batch_size):
            logits = model(input_ids=batch).logits[:, :-1].float()
            targets = batch[:, 1:]
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                       reduction="sum").item()  # fmt: skip
            count += targets.numel()
    model.train()
    return total / count


def train_steps(
    model: torch.nn.Module,
    optimizer,
    scheduler,
    setup: TrainingSetup,
    train_blocks: torch.Tensor,
    order: torch.Tensor,
    start: int,
    stop: int,
    after_step: Callable[[int, float], None],
) -> None:
    """Optimizer steps start+1 .. stop; `after_step(step, loss)` runs after each (untie, evaluate, save)."""
    model.train()
    for step in range(start + 1, stop + 1):
        index = order[(step - 1) * setup.batch_size : step * setup.batch_size]
        batch = train_blocks[index]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        after_step(step, loss.item())


def embedding_digest(model: torch.nn.Module) -> str:
    """A digest of the input embedding's bytes: identifies the weights a checkpoint holds (see `RunRecord`)."""
    return tensor_digest(model.get_input_embeddings().weight)


def save_checkpoint(path: Path, step: int, model, optimizer, scheduler, measured: dict | None = None) -> None:
    """Written to a partial file and renamed: a killed save leaves the previous checkpoint. `measured`: what the run
    has measured so far ({"losses", "digests"}), restored with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "measured": dict(measured or {})}, partial)  # fmt: skip
    partial.replace(path)


def load_checkpoint(path: Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore a checkpoint; returns its step and what the run had measured up to it (`save_checkpoint`)."""
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"], state.get("measured") or {"losses": state.get("losses", {})}  # "losses": before digests


@dataclass
class RunRecord:
    """One finished run: its validation losses at the budgets it reached, and its untie."""

    arm: str
    width: int
    seed: int
    untie_step: int | None
    reason: str | None
    losses: dict[str, float]
    """Budget (steps, as a string: JSON keys) -> validation loss."""
    train_loss_tail: float
    """Mean training loss over the run's last 20 steps (a sanity read, not a result)."""
    setup: dict | None = None
    """The `TrainingSetup` the run was made with: a record made with other settings is run again, not reused."""
    checkpoint_digests: dict[str, str] = field(default_factory=dict)
    """The tied run's branch points: step -> `embedding_digest` of the checkpoint saved there. A branch checks the
    checkpoint it loads against it, so a checkpoint left by another run is refused, not branched from."""
    seconds: float | None = None
    """The run's wall time, in seconds of one process (one thread: the map's cost in core-hours); None in records
    made before it was kept."""

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self), indent=2))
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        return cls(**json.loads(path.read_text()))


class Recorder:
    """`after_step` for `train_steps`: runs the hooks (an `Untier`'s step), evaluates at the budgets, saves the
    checkpoints due at the step (with the losses measured so far, so a resumed run keeps them), reports progress."""

    def __init__(self, model, optimizer, scheduler, validation, budgets: Iterable[int],
                 checkpoints: dict[int, list[Path]], progress: Callable[[int, float], None]) -> None:  # fmt: skip
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.validation = validation
        self.budgets = set(budgets)
        self.checkpoints = checkpoints
        self.progress = progress
        self.losses: dict[str, float] = {}
        self.digests: dict[str, str] = {}
        self.recent: list[float] = []
        self.hooks: list[Callable[[int], None]] = []

    def __call__(self, step: int, loss: float) -> None:
        for hook in self.hooks:
            hook(step)
        self.recent = (self.recent + [loss])[-20:]
        if step in self.budgets:
            self.losses[str(step)] = evaluate(self.model, self.validation)
        paths = self.checkpoints.get(step, [])
        if paths:
            self.digests[str(step)] = embedding_digest(self.model)
        for path in paths:
            save_checkpoint(path, step, self.model, self.optimizer, self.scheduler, self.measured)
        self.progress(1, loss)

    @property
    def measured(self) -> dict:
        """What a resume checkpoint keeps of the run's measurements."""
        return {"losses": dict(self.losses), "digests": dict(self.digests)}

    def resume_from(self, measured: dict) -> None:
        self.losses, self.digests = dict(measured.get("losses", {})), dict(measured.get("digests", {}))

    @property
    def tail(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else math.nan


def fixed_untie_step(fraction: float, budget: int) -> int:
    """The step an untie at `fraction` of a `budget`-step run happens at: the library's own rounding."""
    return resolve_step(fraction, budget, "untie_at")
