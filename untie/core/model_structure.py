"""`ModelStructure`: the attached model's structure, as a run changes it.

It carries out the structure plans the decision gives (`untie.decision.plan.StructurePlan`) on the model and, once
it exists, on the optimizer: the tied phase's implementation (live tying, or emulated under FSDP2 and DeepSpeed:
`untie.engines`), the untie itself (weights and optimizer state), the gradient sync of a head created after DDP
wrapped the model, and the first batch's check of a head drawn by default (`untie.structure.head_start`). It decides
nothing: `untie.core.run.UntieRun` tells it what to reach; every install goes through the run's registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from untie import _compat
from untie.core.phases import RunOrderError
from untie.decision import lines
from untie.decision.plan import ModelFacts, StructurePlan
from untie.decision.settings import OptimizerStateInit
from untie.distributed import sync_grads_across_ranks
from untie.engines import TiedPhase, tied_phase_for
from untie.errors import UntieValueError
from untie.registry import Registry
from untie.structure.facts import model_facts
from untie.structure.head_start import FirstBatchCheck, HeadVerdict
from untie.structure.peft_support import check_peft_run
from untie.structure.surgery import (
    add_param_like,
    draw_head,
    drop_param,
    inner_optimizer,
    input_weight,
    output_weight,
    tie_embeddings,
    untie_embeddings,
)

logger = logging.getLogger(__name__)


class ModelStructure:
    """The structure of `model` during one attachment of a run (see the module docstring).

    Args:
        model: the attached model (unwrapped).
        owner: the adapter's name, for messages.
        registry: the run's registry (every hook and wrapper goes through it).
        engine: the training engine ("FSDP2", "DEEPSPEED" or None).
        tying_mode: the tied phase's implementation resolved for the engine ("live" or "emulated").
    """

    def __init__(self, model: nn.Module, owner: str, registry: Registry, engine: str | None, tying_mode: str) -> None:
        self.model, self.owner, self.registry, self.engine = model, owner, registry, engine
        self.tying_mode = tying_mode
        self.emulation: TiedPhase | None = None
        """The emulated tied phase (a separate head kept equal to the embedding), while it runs."""
        self.first_batch: FirstBatchCheck | None = None
        """The first forward's check of a head drawn by default, until it has judged."""
        self.untie_reason: str | None = None
        """Why a plan untied the model before training ("start", "checkpoint")."""
        self._grad_sync_installed = False
        self._waiting: list = []  # `before_first_forward`'s hooks, taken off by an untie that came first

    def facts(self, optimizer=None) -> ModelFacts:
        """What the model is now (`untie.structure.facts.model_facts`)."""
        return model_facts(self.model, emulating=self.emulation is not None, optimizer_built=optimizer is not None)

    def execute(
        self,
        plan: StructurePlan,
        optimizer=None,
        *,
        draws: bool = False,
        judge: Callable[[HeadVerdict], None] | None = None,
    ) -> None:
        """Carry out `plan`; a head untied before the first step is drawn by the model's initialiser where `draws`,
        and `judge` (a verdict's receiver) makes the draw provisional until the first forward judges it."""
        if plan.refusal is not None:
            raise (RunOrderError if plan.call_order else UntieValueError)(plan.refusal)
        model, facts = self.model, self.facts(optimizer)
        if plan.check_peft:  # PEFT owns the embedding and the head: only a base model untied before wrapping trains
            tied = facts.structure == "tied"
            recorded, keep = facts.config_says_untied, plan.keep_untied
            check_peft_run(model, tied=tied, untie_recorded=recorded, keep_untied=keep, owner=self.owner)
            return
        if plan.warning is not None:
            _compat.warn_in_user_code(plan.warning)
        self.untie_reason = plan.untie_reason or self.untie_reason
        current = facts.structure
        if plan.target == "untied":
            self._reach_untied(current, optimizer, draws, judge)
        elif plan.target == "tied" and current == "untied":
            if plan.drop_head and optimizer is not None:
                drop_param(optimizer, output_weight(model))
            tie_embeddings(model, init=plan.tie_init)
        elif plan.target == "emulated" and current != "emulated":
            if current == "untied":
                tie_embeddings(model, init=plan.tie_init)  # the other matrix is dropped, as for a live tied phase
            untie_embeddings(model)  # the head gets its own parameter now, before wrapping, and trains as if tied
            if self.tying_mode == "live":
                logger.info("untie: the checkpoint was written with emulated tying; this run resumes it emulated.")
            self.tying_mode = "emulated"
            # One implementation per engine (ZeRO reduces and partitions gradients in backward: it ties in autograd).
            self.emulation = tied_phase_for(self.engine, model, self.registry)

    def _reach_untied(self, current: str, optimizer, draws: bool, judge) -> None:
        model = self.model
        if current == "emulated":  # the head has had its own parameter, in the optimizer, from the start
            assert self.emulation is not None
            self.emulation.release()
            self.emulation = None
            if optimizer is None and draws:
                self._draw(judge)  # an untie held back until the checkpoint was known, before sharding
        elif current == "tied" or optimizer is None:
            if current == "tied":
                self._say_if_frozen()
            # On an untied model (a reloaded untie, untie_at=0) this re-applies the bookkeeping a reload loses. A
            # resumed run's head gets its optimizer state from the checkpoint, loaded next.
            untie_embeddings(model, optimizer, optimizer_state="reset")
            if current == "tied" and draws:
                self._draw(judge)  # a resumed run's head is then loaded from its checkpoint
            if optimizer is not None:
                self.install_grad_sync()
        else:  # untied before this resume (untie_at=0, or the model's state dict loaded first): the head must train
            head, embedding = output_weight(model), input_weight(model)
            if not any(p is head for group in inner_optimizer(optimizer).param_groups for p in group["params"]):
                add_param_like(optimizer, new=head, like=embedding, state="reset")
                self.install_grad_sync()

    def _draw(self, judge: Callable[[HeadVerdict], None] | None) -> None:
        draw_head(self.model, self.owner)
        self.drop_check()
        if judge is not None:
            self.first_batch = FirstBatchCheck(self.model, judge, self.registry)

    def before_first_forward(self, what: str, action: Callable[[], None]) -> None:
        """Run `action` once, before the model's next forward (its input embedding's first call)."""

        @torch.compiler.disable  # outside torch.compile's tracing: it changes the model's structure
        def once(*_) -> None:
            handle.remove()
            with torch.inference_mode(False):  # an evaluation first (inference_mode) must not make the head's tensors
                action()

        handle = self.model.get_input_embeddings().register_forward_pre_hook(once)  # type: ignore[operator]
        self.registry.hook(f"{what}, before the first forward", handle)
        self._waiting.append(handle)

    def drop_check(self) -> None:
        """No first-batch check any more (a resumed head is its checkpoint's, or the run resumes tied)."""
        if self.first_batch is not None:
            self.first_batch.remove()
            self.first_batch = None

    def untie(self, optimizer, optimizer_state: OptimizerStateInit) -> None:
        """Untie now, between optimizer steps, the head's optimizer state as `optimizer_state` says."""
        for handle in self._waiting:  # an untie waiting for a forward that never came (inputs_embeds) is this one
            handle.remove()
        self._waiting = []
        if self.emulation is not None:  # the head has existed (and been wrapped) from the start: stop keeping it equal
            self.emulation.release(optimizer, optimizer_state=optimizer_state)
            self.emulation = None
        else:
            self._say_if_frozen()
            untie_embeddings(self.model, optimizer, optimizer_state=optimizer_state)
            self.install_grad_sync()

    def _say_if_frozen(self) -> None:
        """A tied matrix the user froze unties into two identical frozen matrices: say so, with the fix."""
        if not input_weight(self.model).requires_grad:
            _compat.warn_in_user_code(lines.frozen_tied_embedding_text(self.owner))

    def install_grad_sync(self) -> None:
        """Average the head's gradient over ranks: a head created after DDP wrapped the model is not reduced by DDP."""
        if not self._grad_sync_installed:
            handle = sync_grads_across_ranks(output_weight(self.model))
            if handle is not None:
                self.registry.hook("gradient sync of the untied head", handle)
            self._grad_sync_installed = True
