"""`Untier`: tie-then-untie in your own training loop, plain PyTorch or accelerate: one device, DDP, FSDP2, DeepSpeed.

The custom-loop adapter of `untie.core.run.UntieRun` (the run logic `untie.UntieCallback` maps Trainer's events onto):

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

On one device or under DDP with a model that is already tied, `Untier(model, optimizer, accelerator=accelerator, ...)`
after `prepare` does both calls at once (an optimizer from `prepare` is refused without its accelerator).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from untie._compat import is_accelerated_optimizer
from untie.adapters.views import RunViews
from untie.checkpoints.saved_state import (
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
from untie.core.phases import Adapter, RunOrderError
from untie.core.run import UntieRun
from untie.decision import lines
from untie.decision.decide import check_run_length
from untie.decision.plan import SavedFacts, saved_policy_phase
from untie.decision.settings import UntieConfig, build_config, settings_help
from untie.distributed import gathered, training_engine
from untie.errors import UntieFileNotFoundError, UntieValueError
from untie.structure.role_rates import misplaced_roles
from untie.structure.surgery import inner_optimizer, input_weight, output_weight

logger = logging.getLogger(__name__)

#: The custom-loop adapter, its rows of the run's table (`untie.core.phases`) and the order its users follow: start
#: once, steps after it, a state loaded after start and before the first step.
CUSTOM_LOOP = Adapter(
    "Untier",
    "tokenizer=tokenizer",
    {
        "Untier.start": (frozenset({"attached"}), None),
        "Untier.step": (frozenset({"started", "stepping"}), None),
        "Untier.load_state_dict": (frozenset({"started"}), None),
    },
    order=(
        "Untier(model) before the optimizer, untier.start(optimizer) once, untier.load_state_dict(...) or "
        "accelerator.load_state(...) before the first step, untier.step() after each optimizer step, then "
        "untier.close()"
    ),
    loads_after_start=True,
)


class Untier(RunViews):
    """Train tied, then untie the LM head from the input embedding, in a custom training loop.

    With the defaults (`UntieConfig`, policy "by-share"), a model built fresh (its embedding matches a fresh draw of
    its initialiser, or ``from_scratch=True``) follows the study's choice for its embedding's share (untied from step
    0 with its head drawn, or a tied phase to a fraction of `max_steps`), every other tied model trains untied from
    the first step with its head a copy of the embedding. A schedule set (``untie_at=0.3``: tied, the
    trigger, at 30% of `max_steps` at the latest) runs as set. A state loaded later whose run was still tied decides
    instead (`load_state_dict`, `accelerator.load_state`), as under Trainer.

    It does what `UntieCallback` does under Trainer, from the same code (`untie.core.run.UntieRun`): the tied phase
    (live, or emulated under FSDP2 and DeepSpeed), the deadline and the divergence trigger fed by the role gradients
    of each `metrics_every`-th step, the untie with the optimizer state, the gradient sync of a head created after
    DDP wrapped the model, the drift metrics after the untie, and the history.

    Args:
        model: the Hugging Face model (unwrapped, or wrapped by DDP / accelerate: it is unwrapped).
        optimizer: the model's optimizer; pass it here, or later to `start`. Passing it here needs a model whose
            tied-phase structure is already in place (a tied model, live tying). A head untied before the first step
            joins it; under a distributed wrapper built before this call, only a copied head can (the untie then
            happens at the start of training).
        config: the settings (`untie.UntieConfig`, e.g. parsed with `HfArgumentParser`); default `UntieConfig()`.
            `save_at_untie` is Trainer's and is ignored here.
        max_steps: the run's number of optimizer steps. Needed for a fractional `untie_at` you set (``untie_at=0.3``),
            for the default's (0.3) where the run keeps a tied phase (another policy, a resumed tied state; `start`
            asks for it then), and for the short-run warning.
        accelerator: the `accelerate.Accelerator` of the loop, if any. `step()` then counts only the steps that
            sync gradients (not accumulation micro-batches), and `accelerator.save_state` / `load_state` carry the
            untie state (`untie_state.json`) and give a resumed model the checkpoint's structure before it loads.
        tokenizer: the tokenizer, for `pairs="auto"` (and pairs=None, which reads the pairs when it is given).
        lr_scheduler: the LR scheduler, where one is built on `optimizer` already and a learning-rate scale is set
            (`embedding_lr_scale`, `head_lr_scale`): it is given the roles' param groups.
        **overrides: settings by name, over `config` (``Untier(model, untie_at=500, untie_when=None)``).

    Every setting, with its meaning: `untie.UntieConfig` (``help(untie.UntieConfig)``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        config: UntieConfig | None = None,
        max_steps: int | None = None,
        accelerator: Any = None,
        tokenizer: Any = None,
        lr_scheduler: Any = None,
        **overrides: Any,
    ) -> None:
        if optimizer is not None:
            _refuse_prepared_without_accelerator(optimizer, accelerator)
        self.model = _unwrap(model)
        self.accelerator = accelerator
        self.max_steps = max_steps
        self.optimizer: torch.optim.Optimizer | None = None
        self.global_step = 0
        """Optimizer steps done (restored by `load_state_dict`)."""
        config = build_config(config, overrides, "Untier")
        if isinstance(config.untie_at, float) and max_steps is None and config.chosen_policy()[0] == "off":
            # The schedule runs as set (a tied phase for every model). Under a policy, the default's fraction counts
            # only where the plan keeps a tied phase: `start` asks for max_steps then (untie.decision.triggers).
            raise UntieValueError(
                f"Untier: untie_at={config.untie_at} is a fraction of the run: pass max_steps=<the run's optimizer "
                "steps>, or an int step (untie_at=N), or untie_at=None."
            )
        self.run = UntieRun(config, CUSTOM_LOOP)
        """The run logic and state (`untie.core.run.UntieRun`)."""
        self._expected_weights: tuple[dict, str] | None = None  # (fingerprint, where) to check before the next step
        self._state_loaded = False  # the run's state was loaded (`load_state_dict`): the optimizer's may follow
        #: Folders this process writes the untie state into once `accelerator.save_state` ends (None outside a save).
        self._saving_to: list[str] | None = None
        self.run.attach(self.model, engine=training_engine(), tokenizer=tokenizer, optimizer=optimizer)
        try:  # a plan that needs the run's length is refused before anything is installed on the optimizer
            check_run_length(self.run.decision, "Untier", max_steps)  # type: ignore[arg-type]  # attach decided
        except UntieValueError:
            self.run.close()
            raise
        if accelerator is not None:
            registry = self.run.registry
            registry.hook("Untier: accelerator save hook", accelerator.register_save_state_pre_hook(self._save_hook))
            registry.hook("Untier: accelerator load hook", accelerator.register_load_state_pre_hook(self._load_hook))
            self._wrap_save_state(accelerator)
        if optimizer is not None:
            self.start(optimizer, lr_scheduler=lr_scheduler)

    @classmethod
    def from_config(cls, model: nn.Module, config: UntieConfig, **kwargs: Any) -> Untier:
        """An Untier with the settings of `config` (e.g. parsed with `HfArgumentParser`); `kwargs` as for `Untier`."""
        return cls(model, config=config, **kwargs)

    # -- state read by users -------------------------------------------------------------------------------------------
    @property
    def config(self) -> UntieConfig:
        """The settings (`untie.UntieConfig`)."""
        return self.run.config

    # -- the loop -----------------------------------------------------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> None:
        """Begin a fresh run with `optimizer` (after `accelerator.prepare`, or DDP / fully_shard). Resuming, load the
        checkpoint after this call (`accelerator.load_state`, or `load_state_dict` first in a plain loop): the resumed
        run then starts in place of the fresh one (`UntieRun.start` may run again until the first step begins).

        With a learning-rate scale set (`embedding_lr_scale`, `head_lr_scale`), the roles get their param groups here:
        pass `lr_scheduler` if one is built on `optimizer` already (it is given the groups; one built after this call
        sees them anyway).

        `start` arms the first step's measurement (it must be in place before the first forward) but neither changes
        the model's structure (attaching did, at `Untier()`) nor says anything: what the run has to say is said at its
        first optimizer step, about the run then under way, fresh or resumed."""
        _refuse_prepared_without_accelerator(optimizer, self.accelerator)
        self.run.check("Untier.start")  # once: a second call, or an optimizer passed to Untier() already, is refused
        self.optimizer = optimizer
        self.run.split_groups(optimizer, lr_scheduler)
        # The step's gradients are complete when the optimizer steps (after every micro-batch, every rank): measure
        # then, as UntieCallback does in Trainer's on_pre_optimizer_step.
        inner = inner_optimizer(optimizer)
        registry = self.run.registry
        if hasattr(inner, "register_step_pre_hook"):
            registry.hook("Untier: measure before the step", inner.register_step_pre_hook(self._before_optimizer_step))
        else:
            # DeepSpeed's ZeRO optimizer (not a torch optimizer; under accelerate the engine steps inside backward):
            # nothing to measure, and the loaded weights are checked at the first forward, before the engine steps.
            lookup: Any = self.model.get_input_embeddings()  # type: ignore[operator]  # a PreTrainedModel's method
            hook = lookup.register_forward_pre_hook(torch.compiler.disable(lambda *_: self._check_loaded_weights()))
            registry.hook("Untier: check loaded weights before the first forward", hook)
        if hasattr(inner, "register_load_state_dict_pre_hook"):
            handle = inner.register_load_state_dict_pre_hook(self._before_optimizer_state_loads)
            registry.hook("Untier: the run's state loads before the optimizer's", handle)
        self._start(None, "")

    def _before_optimizer_state_loads(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Refuse, naming the order, an optimizer state loaded after `start` and before the run's own state
        (`load_state_dict`), into param groups the run set up for a fresh start that it does not fit: torch would
        raise about group counts and say nothing of the cause."""
        if self._state_loaded or self.run.phase != "started":
            return
        saved = [len(group["params"]) for group in state.get("param_groups", [])]
        sizes = [len(group["params"]) for group in optimizer.param_groups]
        if saved != sizes:
            found = (
                f"its param groups hold {saved} parameters, this optimizer's {sizes}, which the run set up for a fresh "
                "start (the checkpoint's run had another structure or other groups: an untied head, a role's own "
                "group for its learning rate)"
            )
            raise RunOrderError(lines.optimizer_state_first_text("Untier", found))

    def _start(self, saved: dict | None, where: str) -> None:
        """Start the run at `global_step`, fresh or from `saved`, and arm its first step."""
        self.run.start(self.optimizer, self.global_step, self.max_steps, saved, where)
        self.run.arm(self.global_step + 1)

    def _before_optimizer_step(self, *_args) -> None:
        self._check_loaded_weights()
        self.run.measure(self.global_step + 1)

    def step(self) -> dict[str, float]:
        """Call once after each optimizer step. Unties when the trigger fires or the deadline is reached.

        With an `accelerator`, calls on gradient-accumulation micro-batches (`accelerator.sync_gradients` False) do
        nothing, so it can sit next to `optimizer.step()` inside `accelerator.accumulate`. Every rank must call it.

        Returns:
            The `untie/*` values to log at this step (`untie/tied`, `untie/untie_step`, the step's measurement)
            when it measured or untied, else an empty dict: e.g. `accelerator.log(untier.step(), step=step)`.
        """
        self.run.check("Untier.step")  # after untier.start(optimizer), before close
        if self.accelerator is not None and not self.accelerator.sync_gradients:
            return {}
        self._check_loaded_weights()
        self.global_step += 1
        step = self.global_step
        self.run.measure(step)  # a no-op unless the optimizer skipped this step (GradScaler overflow) unmeasured
        reason = self.run.end_of_step(step)
        self.run.arm(step + 1)
        return self.run.take_latest() if (self.run.measurements.latest or reason) else {}

    def close(self) -> None:
        """The run is over: take every install off the model, the optimizer and the accelerator (`UntieRun.close`);
        the model keeps its structure (an untied head, its config marker)."""
        self.run.close()

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run state, JSON-able: save it with the model and the optimizer.

        It records the weights it belongs to (`untie.checkpoints.saved_state.weights_fingerprint`: whether the head is
        its own tensor, the embedding's and the head's shapes, dtypes and digests), so that a resume can prove that the
        weights it loads are the ones saved with it. Under DeepSpeed ZeRO-3 it gathers the two matrices: every rank must
        call it."""
        return self.run.state_dict(self.global_step, weights=self._fingerprint())

    def _fingerprint(self) -> dict:
        """`weights_fingerprint` of the model; under DeepSpeed ZeRO-3 of the gathered matrices (every rank calls)."""
        with gathered(input_weight(self.model), output_weight(self.model)):
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
        self.run.check("Untier.load_state_dict")  # after start (the head joins the optimizer), before any step
        state = check_state(state, where)
        attributes = state["attributes"]
        groups = attributes.get("lr_groups")
        self._refuse_optimizer_state_loaded_first()
        self._state_loaded = True
        saved = SavedFacts(
            "the checkpoint",
            untied=attributes["untied"],
            head_stored=state.get("tying_mode") == "emulated",
            lr_groups=tuple(groups) if isinstance(groups, list) else None,
            policy_phase=saved_policy_phase(attributes),
        )
        self.run.split_groups(self.optimizer, saved=saved)  # the checkpoint's groups, before its optimizer state loads
        self.run.expect_checkpoint(saved, self.optimizer)
        self.global_step = state["global_step"]
        self._start(state, where)
        expected = state["weights"]
        if expected is None:  # a Trainer checkpoint's state: no fingerprint to compare
            return
        self._expected_weights = None if weights_checked else (expected, where)

    def _refuse_optimizer_state_loaded_first(self) -> None:
        """An optimizer state that fitted the fresh start's group sizes but was laid out for other roles loaded by
        position: its groups now carry the checkpoint's role marks over the fresh start's parameters. Refuse it
        before anything changes."""
        optimizer = self.optimizer
        if optimizer is None or not getattr(inner_optimizer(optimizer), "state", None):
            return  # nothing loaded yet: the run's state comes first, as it should
        wrong = misplaced_roles(optimizer, self.model)
        if wrong:
            names = " and ".join(f"the {role.replace('_', ' ')}'s" for role in wrong)
            found = f"it already holds state, and {names} group holds another parameter (the checkpoint's layout)"
            raise RunOrderError(lines.optimizer_state_first_text("Untier", found))

    def _check_loaded_weights(self) -> None:
        """Refuse weights that were not saved with the untie state `load_state_dict` restored (once, before the first
        optimizer step after it: the weights are then exactly the ones loaded)."""
        if self._expected_weights is None:
            return
        (expected, where), self._expected_weights = self._expected_weights, None
        if self.run.untied and not expected["separate_head"]:
            # A deadline already passed (settings changed on resume) untied the model at the resume step, at its first
            # forward: the head is a copy of the checkpoint's shared matrix.
            expected = {**expected, "separate_head": True, "head": expected["embedding"]}
        difference = fingerprint_difference(expected, self._fingerprint())
        if difference is not None:
            raise UntieStateError(
                f"Untier: {difference}: the model's weights and {where} come from different checkpoints (other "
                "steps, or another run), and resuming would continue a run that never happened. Load the model's "
                "and the optimizer's state dicts saved together with this untie state, after "
                "untier.load_state_dict()."
            )

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

        self.run.registry.replace(
            "Untier: accelerator.save_state writes the untie state last",
            accelerator,
            "save_state",
            save_state_then_untie_state,
        )

    def _writes_state(self) -> bool:
        """Whether this process writes the untie state: where accelerate writes the model, once, or once per node with
        `ProjectConfiguration(save_on_each_node=True)` (each node's folder must resume on its own)."""
        accelerator = self.accelerator
        if accelerator.project_configuration.save_on_each_node:
            return accelerator.is_local_main_process
        return accelerator.is_main_process

    def _save_hook(self, models, weights, output_dir: str) -> None:
        """The folder accelerate writes into (named by then, also with automatic checkpoint naming): its old untie
        state goes now, the new one once `save_state` has written everything else."""
        if not self._writes_state():
            return
        if self._saving_to is None:  # a save_state bound before this Untier wrapped it: write now, as a fallback
            write_state_file(output_dir, self.state_dict())
            return
        remove_state_file(output_dir)
        self._saving_to.append(output_dir)

    def _load_hook(self, models, input_dir: str) -> None:
        """Check the folder's untie state and that the weights beside it are the ones it was saved with, then give the
        model the saved structure before accelerate loads the weights and the optimizer into it."""
        state = read_state_file(input_dir)
        if not has_weights(input_dir):
            raise UntieFileNotFoundError(
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


def _refuse_prepared_without_accelerator(optimizer: torch.optim.Optimizer, accelerator: Any) -> None:
    """An optimizer from `accelerator.prepare` needs its accelerator: without it the run would count micro-batches as
    steps and `save_state` would not carry its state. Refused before anything is installed."""
    if accelerator is None and is_accelerated_optimizer(optimizer):
        raise UntieValueError(lines.accelerator_missing_text("Untier"))


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP, torch.compile or accelerate's wrappers."""
    return extract_model_from_parallel(model, keep_fp32_wrapper=True)


Untier.__doc__ = f"{Untier.__doc__}\n\n    {settings_help().replace(chr(10), chr(10) + '    ')}"
