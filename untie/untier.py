"""`Untier`: tie-then-untie in your own training loop, plain PyTorch or accelerate: one device, DDP, FSDP2, DeepSpeed.

The custom-loop adapter of `untie.run.UntieRun` (the run logic `untie.UntieCallback` maps Trainer's events onto):

    untier = untie.Untier(model, max_steps=1000, accelerator=accelerator)   # before the optimizer and prepare()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    untier.start(optimizer)                  # then accelerator.load_state(folder) when resuming
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        untier.step()                        # once per optimizer step: it ignores accumulation micro-batches

On one device or under DDP with a model that is already tied, `Untier(model, optimizer, ...)` after `prepare` does
both calls at once.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Literal

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from untie.config import DEFAULT_UNTIE_AT, OptimizerStateInit, RuleSpec, TieInit, TyingMode, UntieConfig
from untie.distributed import gathered, is_sharded, training_engine
from untie.pairs import is_tokenizer
from untie.plan import SavedFacts
from untie.run import CUSTOM_LOOP, UntieRun
from untie.saved_state import (
    STATE_FILE,
    UntieStateError,
    check_state,
    fingerprint_difference,
    has_weights,
    read_state_file,
    remove_state_file,
    stored_fingerprint,
    weights_fingerprint,
    write_state_file,
)
from untie.surgery import inner_optimizer, is_tied

logger = logging.getLogger(__name__)


class Untier:
    """Train tied, then untie the LM head from the input embedding, in a custom training loop.

    It does what `UntieCallback` does under Trainer, from the same code (`untie.run.UntieRun`): the tied phase
    (live, or emulated under FSDP2 and DeepSpeed), the deadline and the divergence trigger fed by the role gradients
    of each `metrics_every`-th step, the untie with the optimizer state, the gradient sync of a head created after
    DDP wrapped the model, the drift metrics after the untie, and the history.

    Args:
        model: the Hugging Face model (unwrapped, or wrapped by DDP / accelerate: it is unwrapped).
        optimizer: the model's optimizer; pass it here, or later to `start`. Passing it here needs a model whose
            tied-phase structure is already in place (a tied model, live tying): the untie cannot add a parameter the
            optimizer and the wrapper have already been built without.
        max_steps: the run's number of optimizer steps. Needed for a fractional `untie_at` (the default, 0.3) and
            for the short-run warning.
        accelerator: the `accelerate.Accelerator` of the loop, if any. `step()` then counts only the steps that
            sync gradients (not accumulation micro-batches), and `accelerator.save_state` / `load_state` carry the
            untie state (`untie_state.json`) and give a resumed model the checkpoint's structure before it loads.
        tokenizer: the tokenizer, for `pairs="auto"` (and pairs=None, which reads the pairs when it is given).
        untie_at: the untie step at the latest (int), or a fraction of `max_steps` (float); None: no deadline.
        untie_when: the divergence trigger: "divergence" (default rule), a name from `untie.RULES`, an
            `untie.UntieWhen`, or None (a fixed schedule at `untie_at`).
        metrics_every: measure every this many optimizer steps (0: never; needs ``untie_when=None``).
        pairs: token-id pairs to measure, "auto" (from `tokenizer`), None ("auto" when a tokenizer is given), [].
        optimizer_state: the untied head's optimizer state: "copy", "reset", or "fresh" (the embedding's too).
        tie_init: an untied model: None (default) keeps it untied from the first step (nothing trained is
            dropped); "input", "output" or "mean" ties it from that matrix (or their mean).
        tying_mode: "live", "emulated" (FSDP2, DeepSpeed) or "auto".

    The settings are the fields of `untie.UntieConfig` (its docs say more) but `save_at_untie`, which is Trainer's.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        max_steps: int | None = None,
        accelerator: Any = None,
        tokenizer: Any = None,
        untie_at: int | float | None = DEFAULT_UNTIE_AT,
        untie_when: RuleSpec = "divergence",
        metrics_every: int = 50,
        pairs: list[tuple[int, int]] | Literal["auto"] | None = None,
        optimizer_state: OptimizerStateInit = "copy",
        tie_init: TieInit | None = None,
        tying_mode: TyingMode = "auto",
    ) -> None:
        self.model = _unwrap(model)
        self.accelerator = accelerator
        self.max_steps = max_steps
        self.optimizer: torch.optim.Optimizer | None = None
        self.global_step = 0
        """Optimizer steps done (restored by `load_state_dict`)."""
        self._begun_at: int | None = None  # the step a run began at and has not announced yet (see `_begin`)
        config = UntieConfig(
            untie_at=untie_at,
            untie_when=untie_when,
            metrics_every=metrics_every,
            pairs=pairs,
            optimizer_state=optimizer_state,
            tie_init=tie_init,
            tying_mode=tying_mode,
        )
        if isinstance(config.untie_at, float) and max_steps is None:
            raise ValueError(
                f"Untier: untie_at={config.untie_at} is a fraction of the run: pass max_steps=<the run's optimizer "
                "steps>, or an int step (untie_at=N), or untie_at=None."
            )
        self.run = UntieRun(config, CUSTOM_LOOP)
        """The run logic and state (`untie.run.UntieRun`)."""
        self.run.use_tying_mode(training_engine())
        if config.pairs == "auto" or (config.pairs is None and is_tokenizer(tokenizer)):
            self.run.read_pairs(tokenizer, self.model, asked=config.pairs == "auto")
        self.run.match_rule_to_pairs()
        self._hooks: list = []
        self._expected_weights: tuple[dict, str] | None = None  # (fingerprint, where) to check before the next step
        #: Folders this process writes the untie state into once `accelerator.save_state` ends (None outside a save).
        self._saving_to: list[str] | None = None
        if is_sharded(self.model.get_input_embeddings().weight) and self.run.tying_mode == "emulated":
            if is_tied(self.model):
                raise RuntimeError(
                    "Untier: the model is already sharded (fully_shard / accelerator.prepare) and still tied: emulated "
                    "tying gives the head its own parameter before sharding. Create the Untier before fully_shard, "
                    "before building the optimizer and before accelerator.prepare; then call untier.start(optimizer)."
                )
        self.run.prepare(self.model, optimizer)
        if optimizer is not None:
            self.start(optimizer)
        if accelerator is not None:
            self._hooks.append(accelerator.register_save_state_pre_hook(self._save_with_accelerator))
            self._hooks.append(accelerator.register_load_state_pre_hook(self._load_with_accelerator))
            self._wrap_save_state(accelerator)

    # -- state read by users ------------------------------------------------------------------------------------------
    @property
    def config(self) -> UntieConfig:
        """The settings (`untie.UntieConfig`)."""
        return self.run.config

    @property
    def untied(self) -> bool:
        return self.run.untied

    @property
    def untie_step(self) -> int | None:
        return self.run.untie_step

    @property
    def untie_reason(self) -> str | None:
        """Why the model was untied: "trigger", "deadline", "checkpoint" or "start"."""
        return self.run.untie_reason

    @property
    def history(self) -> list[dict[str, float]]:
        """Every measurement: {"step": ..., signal: value, ...}."""
        return self.run.history

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return self.run.pairs

    @property
    def tying_mode(self) -> str | None:
        return self.run.tying_mode

    @property
    def divergence(self):
        """The divergence trigger (`untie.triggers.DivergenceTrigger`) or None."""
        return self.run.divergence

    # -- the loop -----------------------------------------------------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """Begin a fresh run with `optimizer` (after `accelerator.prepare`, or DDP / fully_shard). Resuming, load the
        checkpoint after this call (`accelerator.load_state`, or `load_state_dict` first in a plain loop): the resumed
        run then begins in place of the fresh one.

        Start and resume are separate: `start` arms the first step's measurement (it must be in place before the first
        forward) but neither changes the model's structure (the plan did at `Untier()`) nor says anything; a resume
        gives the model the checkpoint's structure and begins the run at the checkpoint's step. What the run has to
        say (a trigger that cannot fire in the run's length) is said once, at the first optimizer step, about the run
        that is then under way, fresh or resumed."""
        if self.optimizer is not None:
            raise RuntimeError("Untier.start() was already called (or the optimizer was passed to Untier()).")
        self.optimizer = optimizer
        # The step's gradients are complete when the optimizer steps (after every micro-batch, every rank): measure
        # then, as UntieCallback does in Trainer's on_pre_optimizer_step.
        inner = inner_optimizer(optimizer)
        if hasattr(inner, "register_step_pre_hook"):
            self._hooks.append(inner.register_step_pre_hook(self._before_optimizer_step))
        else:
            # DeepSpeed's ZeRO optimizer (not a torch optimizer; under accelerate the engine steps inside backward):
            # nothing to measure, and the loaded weights are checked at the first forward, before the engine steps.
            lookup = self.model.get_input_embeddings()
            self._hooks.append(lookup.register_forward_pre_hook(lambda *_: self._check_loaded_weights()))
        self.run.restore({}, 0)
        self._begin()

    def _begin(self) -> None:
        """Begin the run at `global_step` (fresh at `start`, or the resumed one after a load); it announces itself at
        its first optimizer step."""
        self.run.begin(self.model, self.optimizer, self.global_step, self.max_steps)
        self.run.arm(self.global_step + 1)
        self._begun_at = self.global_step

    def _announce_once(self) -> None:
        if self._begun_at is not None:
            step, self._begun_at = self._begun_at, None
            self.run.announce(step, self.max_steps)

    def _before_optimizer_step(self, *_args) -> None:
        self._check_loaded_weights()
        self._announce_once()
        self.run.measure(self.global_step + 1)

    def step(self) -> dict[str, float]:
        """Call once after each optimizer step. Unties when the trigger fires or the deadline is reached.

        With an `accelerator`, calls on gradient-accumulation micro-batches (`accelerator.sync_gradients` False) do
        nothing, so it can sit next to `optimizer.step()` inside `accelerator.accumulate`. Every rank must call it.

        Returns:
            The `untie/*` values to log at this step (`untie/tied`, `untie/untie_step`, the step's measurement)
            when it measured or untied, else an empty dict: e.g. `accelerator.log(untier.step(), step=step)`.
        """
        if self.optimizer is None:
            raise RuntimeError("Untier.step() before untier.start(optimizer): pass the optimizer first.")
        if self.accelerator is not None and not self.accelerator.sync_gradients:
            return {}
        self._check_loaded_weights()
        self._announce_once()  # the optimizer hook did, unless it skipped its step (GradScaler overflow)
        self.global_step += 1
        step = self.global_step
        self.run.measure(step)  # a no-op unless the optimizer skipped this step (GradScaler overflow) unmeasured
        reason = self.run.end_of_step(self.model, self.optimizer, step)
        self.run.arm(step + 1)
        return self.run.take_latest() if (self.run.latest or reason) else {}

    def close(self) -> None:
        """Take every hook off (the run is over)."""
        self.run.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.accelerator is not None and getattr(self.accelerator.save_state, "_untie_owner", None) is self:
            del self.accelerator.save_state  # back to Accelerator.save_state

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run state, JSON-able: save it with the model and the optimizer.

        It records the weights it belongs to (`untie.saved_state.weights_fingerprint`: whether the head is its own
        tensor, the embedding's and the head's shapes, dtypes and digests), so that a resume can prove that the
        weights it loads are the ones saved with it. Under DeepSpeed ZeRO-3 it gathers the two matrices: every rank
        must call it."""
        return self.run.state_dict(self.global_step, weights=self._fingerprint())

    def _fingerprint(self) -> dict:
        """`weights_fingerprint` of the model; under DeepSpeed ZeRO-3 of the gathered matrices (every rank calls)."""
        with gathered(self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight):
            return weights_fingerprint(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the run saved by `state_dict`: call it after `start`, and before loading the model's and the
        optimizer's state dicts, so that they load into the checkpoint's structure (an untied checkpoint gets an
        untied model, with the head in the optimizer). Every rank must call it.

        A damaged state raises `UntieStateError`. Before the next optimizer step, the model's embedding and head are
        compared with the weights this state was saved with: weights from another step or run raise
        `UntieStateError` instead of resuming into a different run."""
        self._restore(state, "the state given to Untier.load_state_dict")

    def _restore(self, state: Any, where: str, *, weights_checked: bool = False) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                "Untier.load_state_dict() before untier.start(optimizer): the untied head must join the optimizer "
                "before the optimizer's state loads."
            )
        state = check_state(state, where)
        attributes = state["attributes"]
        self._match_structure(attributes["untied"], state.get("tying_mode"))
        self.global_step = state["global_step"]
        self.run.load_state_dict(state, where)
        self._begin()
        expected = state["weights"]
        if expected is None:  # a Trainer checkpoint's state: no fingerprint to compare
            return
        if self.run.untied and not attributes["untied"]:
            # A deadline already passed (settings changed on resume) untied the model at this step: the head is a
            # copy of the checkpoint's shared matrix once the weights load.
            expected = {**expected, "separate_head": True, "head": expected["embedding"]}
        self._expected_weights = None if weights_checked else (expected, where)

    def _check_loaded_weights(self) -> None:
        """Refuse weights that were not saved with the untie state `load_state_dict` restored (once, before the first
        optimizer step after it: the weights are then exactly the ones loaded)."""
        if self._expected_weights is None:
            return
        (expected, where), self._expected_weights = self._expected_weights, None
        difference = fingerprint_difference(expected, self._fingerprint())
        if difference is not None:
            raise UntieStateError(
                f"Untier: {difference}: the model's weights and {where} come from different checkpoints (other "
                "steps, or another run), and resuming would continue a run that never happened. Load the model's "
                "and the optimizer's state dicts saved together with this untie state, after "
                "untier.load_state_dict()."
            )

    def _match_structure(self, untied: bool, saved_mode: str | None) -> None:
        """Give the model and the optimizer the structure of the saved run, before their states load."""
        saved = SavedFacts("the checkpoint", untied=untied, head_stored=saved_mode == "emulated")
        self.run.match_saved(self.model, saved, self.optimizer)

    def _wrap_save_state(self, accelerator: Any) -> None:
        """Make `accelerator.save_state` write the untie state last, once every rank has written its files.

        accelerate has no post-save hook, and its pre-save hook runs before the weights are written (except under
        FSDP). A state written there would sit next to the old weights of a folder being overwritten in place if the
        save were killed; written last, and removed first, a folder either has a complete save or no untie state,
        which `load_state` refuses by name."""
        save_state = accelerator.save_state

        @functools.wraps(save_state)
        def save_state_then_untie_state(output_dir: str | None = None, *args, **kwargs):
            if output_dir is not None and self._writes_state() and os.path.isdir(output_dir):
                remove_state_file(output_dir)  # before accelerate overwrites anything (FSDP writes before the hook)
            self._saving_to = []
            try:
                location = save_state(output_dir, *args, **kwargs)
                accelerator.wait_for_everyone()  # every rank's files (its RNG state) are on disk
                state = self.state_dict()  # on every rank: a collective under ZeRO-3
                for folder in self._saving_to:
                    write_state_file(folder, state)
            finally:
                self._saving_to = None
            return location

        save_state_then_untie_state._untie_owner = self  # marks the wrapper, so that close() can take it off
        accelerator.save_state = save_state_then_untie_state

    def _writes_state(self) -> bool:
        """Whether this process writes the untie state: where accelerate writes the model, once, or once per node with
        `ProjectConfiguration(save_on_each_node=True)` (each node's folder must resume on its own)."""
        accelerator = self.accelerator
        if accelerator.project_configuration.save_on_each_node:
            return accelerator.is_local_main_process
        return accelerator.is_main_process

    def _save_with_accelerator(self, models, weights, output_dir: str) -> None:
        """The folder accelerate writes into (named by then, also with automatic checkpoint naming): its old untie
        state goes now, the new one once `save_state` has written everything else."""
        if not self._writes_state():
            return
        if self._saving_to is None:  # a save_state bound before this Untier wrapped it: write now, as a fallback
            write_state_file(output_dir, self.state_dict())
            return
        remove_state_file(output_dir)
        self._saving_to.append(output_dir)

    def _load_with_accelerator(self, models, input_dir: str) -> None:
        """Check the folder's untie state and that the weights beside it are the ones it was saved with, then give the
        model the saved structure before accelerate loads the weights and the optimizer into it."""
        state = read_state_file(input_dir)
        if not has_weights(input_dir):
            raise FileNotFoundError(
                f"Untier: the checkpoint {input_dir} is incomplete: it has {STATE_FILE} but no model weights "
                "(model.safetensors, pytorch_model.bin or FSDP's pytorch_model_fsdp_* folder): a copy or a save that "
                "stopped part way. Resume from the previous complete folder."
            )
        where = os.path.join(input_dir, STATE_FILE)
        stored = stored_fingerprint(input_dir, self.model, self._model_index(models))
        if stored is not None and state["weights"] is not None:
            difference = fingerprint_difference(state["weights"], stored)
            if difference is not None:
                raise UntieStateError(
                    f"Untier: {difference}: {where} and the weights in {input_dir} were not saved together (a save "
                    "killed while overwriting this folder, or files copied from another step or run). Resume from "
                    "another complete folder, or copy the whole folder of one save."
                )
        self._restore(state, where, weights_checked=stored is not None)

    def _model_index(self, models) -> int:
        """The index accelerate saves this Untier's model under (its `model_{i}` files)."""
        return next((i for i, model in enumerate(models) if _unwrap(model) is self.model), 0)


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP, torch.compile or accelerate's wrappers."""
    return extract_model_from_parallel(model, keep_fp32_wrapper=True)
