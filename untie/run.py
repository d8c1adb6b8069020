"""`UntieRun`: the run logic of a tie-then-untie training run, shared by every adapter.

One object holds what a run decides and remembers: the model's tied-phase structure (live or emulated tying), the
deadline and the divergence trigger, the role-gradient probe that feeds the trigger, the untie itself (optimizer
state, the gradient sync of a head created after DDP wrapped the model), the drift metrics after it, and the
history. It knows nothing of who drives the loop. The adapters translate their loop's events into its calls:

* `untie.UntieCallback`: Trainer's events (`on_train_begin`, `on_pre_optimizer_step`, `on_step_end`, ...);
* `untie.Untier`: a custom PyTorch or accelerate loop (one `step()` per optimizer step).

The calls, in a run's order: `read_pairs` / `use_tying_mode` / `prepare(model)` before the optimizer exists and the
model is wrapped; `restore(saved, step)` on resume; `begin(model, optimizer, step, max_steps)`; then per optimizer
step `arm(step)` before its first forward, `measure(step)` once its gradients are complete (before the optimizer
step) and `end_of_step(model, optimizer, step)` after it; `close()` at the end.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torch import nn

from untie import _compat
from untie.checkpoint import install_resume_guard
from untie.config import UntieConfig
from untie.distributed import (
    broadcast_decision,
    full_shape,
    gather_rows,
    gathered,
    is_sharded,
    resolve_tying_mode,
    sync_grads_across_ranks,
)
from untie.emulation import EmulatedTying
from untie.metrics import drift_metrics, role_signals_on_rows, sampled_drift_metrics, summarize_pair_metrics
from untie.pairs import tokenizer_pairs
from untie.peft_support import check_peft_run, is_peft_model
from untie.plan import ModelFacts, RunSettings, SavedFacts, Structure, StructurePlan, plan_structure
from untie.probe import RoleGradientProbe
from untie.saved_state import STATE_FORMAT, check_state
from untie.surgery import (
    add_param_like,
    inner_optimizer,
    is_tied,
    tie_embeddings,
    untie_embeddings,
    untie_recorded,
    was_untied,
)
from untie.triggers import DivergenceTrigger, ScheduledTrigger, UntieWhen, default_rule, pair_signal
from untie.zero_tying import ZeroTying

logger = logging.getLogger(__name__)

#: Sample sizes of the drift metrics measured during training: about 0.1 s on CPU for GPT-2 small.
_DRIFT_SAMPLE = {"queries": 256, "pool": 4096, "rows": 2048}


@dataclass(frozen=True)
class Adapter:
    """What an adapter tells the run about itself: the name users wrote (warnings and errors name it) and how a
    tokenizer reaches it (for ``pairs="auto"``). The run's behaviour does not depend on it."""

    name: str
    tokenizer_hint: str


#: The Trainer callback (`untie.UntieCallback`) and the custom-loop adapter (`untie.Untier`).
TRAINER_CALLBACK = Adapter("UntieCallback", "Trainer(processing_class=tokenizer)")
CUSTOM_LOOP = Adapter("Untier", "tokenizer=tokenizer")

#: The run state a checkpoint keeps (the "attributes" of `UntieRun.state_dict`, read back by `restore`).
SAVED_ATTRIBUTES = ("untied", "untie_step", "untie_reason", "trigger_state", "history")


class UntieRun:
    """The state and decisions of one tie-then-untie run, driven by an adapter (see the module docstring).

    Args:
        config: the run's settings (`untie.UntieConfig`).
        adapter: who drives the run (`TRAINER_CALLBACK`, `CUSTOM_LOOP`): messages name it.
    """

    def __init__(self, config: UntieConfig, adapter: Adapter = TRAINER_CALLBACK) -> None:
        self.config = config
        self.adapter = adapter
        self.owner = adapter.name
        self.deadline = ScheduledTrigger(config.untie_at)
        """`untie_at`: the divergence trigger's deadline, or the fixed schedule when there is no trigger."""
        self.rule = config.rule(with_pairs=config.pairs != [])
        """The divergence trigger's rule (`untie.UntieWhen`), "divergence" resolved (`match_rule_to_pairs`); None."""
        self.divergence: DivergenceTrigger | None = DivergenceTrigger(self.rule) if self.rule else None
        self.untied = False
        self.untie_step: int | None = None
        self.untie_reason: str | None = None
        """Why the model was untied: "trigger" (divergence), "deadline" (untie_at) or "checkpoint"/"start"."""
        self.pairs: list[tuple[int, int]] = list(config.pairs) if isinstance(config.pairs, list) else []
        """The measured pairs: `config.pairs`, or those read from the tokenizer (`read_pairs`)."""
        self.history: list[dict[str, float]] = []
        """Every measurement: {"step": ..., signal: value, ...}; the smoothed trigger signal as "trigger"."""
        self.tying_mode: str | None = None
        """The tied phase's implementation, "live" or "emulated" (`use_tying_mode`)."""
        self.engine: str | None = None
        """The engine that trains (`untie.distributed.training_engine`): "FSDP2", "DEEPSPEED" or None."""
        self.emulation: EmulatedTying | ZeroTying | None = None
        self.latest: dict[str, float] = {}
        """The last measurement, summarised for logging (`untie/<key>`); cleared by `take_latest`."""
        self.probe: RoleGradientProbe | None = None
        self.planned_untie_reason: str | None = None
        """Why the structure plan untied the model before training ("start", "checkpoint"), for `begin`."""
        self._grad_sync_handle = None
        self._unmeasured_warned = False
        self._no_pairs_because: str | None = None
        """Why `read_pairs` found no pairs, for the default rule's warning (None: it found some, or never read)."""
        self._rule_change_said = False

    # -- before the optimizer exists ----------------------------------------------------------------------------------
    def read_pairs(self, tokenizer, model, asked: bool) -> None:
        """Measure the tokenizer's most frequent case and word-start variants that the model has rows for.

        `asked`: the user chose pairs="auto" (a missing tokenizer is an error, an empty result a warning); else
        pairs=None found a tokenizer (an empty result is only logged).
        """
        if tokenizer is None:
            raise ValueError(
                f"{self.owner}(pairs='auto') reads the pairs from the tokenizer: pass it ({self._tokenizer_hint}), or "
                "list the pairs yourself: pairs=[(id_a, id_b), ...]."
            )
        rows = full_shape(model.get_input_embeddings().weight)[0] if model is not None else None
        pairs = tokenizer_pairs(tokenizer, max_id=rows)
        within = f" among the model's {rows} embedding rows" if rows is not None else ""
        if pairs:
            shown = ", ".join("/".join(p.tokens) for p in pairs[:6])
            logger.info("untie: pairs='auto' measures %d pairs from the tokenizer (%s, ...)", len(pairs), shown)
        elif asked:
            _compat.warn_in_user_code(
                f"{self.owner}(pairs='auto'): the tokenizer's vocabulary has no case or word-start variants{within}, "
                "so no pair is measured. Pass pairs=[(id_a, id_b), ...]."
            )
        else:
            self._no_pairs_because = f"the tokenizer's vocabulary has no case or word-start variants{within}"
        self.pairs = [p.ids for p in pairs]

    @property
    def _tokenizer_hint(self) -> str:
        return self.adapter.tokenizer_hint

    def match_rule_to_pairs(self) -> None:
        """With pairs=None, "divergence" is the evidence rule only if the tokenizer gave pairs: else the pair-free
        rule. A per-pair rule the user chose, with no pairs to read, is refused."""
        rule = self.rule
        if rule is None or self.pairs or pair_signal(rule.signal) is None:
            return
        if self.config.is_default_rule:
            self.rule = default_rule(with_pairs=False)
            self.divergence = DivergenceTrigger(self.rule)
            if self.config.pairs is not None or self._rule_change_said:
                return  # pairs=[] is the user's choice; pairs="auto" has warned already
            self._rule_change_said = True
            logger.warning(
                "untie: the default trigger reads no pairs: %s. It uses the pair-free rule (untie_when='cancellation') "
                "instead of the evidence rule. To measure pairs, pass the tokenizer (%s) or pairs=[(id_a, id_b), ...]; "
                "untie_when='cancellation' chooses this rule and silences this message.",
                self._no_pairs_because or "no tokenizer was given",
                self._tokenizer_hint,
            )
            return
        raise ValueError(
            f"untie_when.signal={rule.signal!r} reads pairs, and there are none: no tokenizer to read them from "
            f"({self._tokenizer_hint}) or its vocabulary has no case or word-start variants. Pass pairs=[(id_a, "
            "id_b), ...], or a pair-free rule (untie_when='cancellation')."
        )

    def use_tying_mode(self, engine: str | None) -> None:
        """Resolve `config.tying_mode` for the engine that trains (`untie.distributed.training_engine`)."""
        self.tying_mode = resolve_tying_mode(self.config.tying_mode, engine)
        self.engine = engine

    def settings(self) -> RunSettings:
        """The settings `plan_structure` decides from (the tying mode resolved by `use_tying_mode`)."""
        config = self.config
        mode = self.tying_mode or ("emulated" if config.tying_mode == "emulated" else "live")
        return RunSettings(self.owner, config.untie_at, mode, config.tying_mode, config.tie_init)

    def prepare(self, model: nn.Module, optimizer=None) -> None:
        """Give the model its tied-phase structure, before the optimizer exists and the model is wrapped (with an
        `optimizer` already built, refuse a structure it was built without)."""
        self.emulation = None
        if not is_peft_model(model):
            install_resume_guard(model)
        plan = plan_structure(model_facts(model, optimizer_built=optimizer is not None), self.settings())
        self.apply_plan(model, plan)

    def match_saved(self, model: nn.Module, saved: SavedFacts, optimizer=None) -> None:
        """Give the model the structure of the checkpoint's run (`saved`), before its weights and the optimizer's
        state load, so that they fit the same structure. With `optimizer` (a custom loop resuming after `start`),
        a head the untie adds joins it."""
        facts = model_facts(model, emulating=self.emulation is not None, optimizer_built=optimizer is not None)
        self.apply_plan(model, plan_structure(facts, self.settings(), saved), optimizer)

    def apply_plan(self, model: nn.Module, plan: StructurePlan, optimizer=None) -> None:
        """Carry out `plan` (`untie.plan.plan_structure`) on the model, and on the optimizer if it exists."""
        if plan.refusal is not None:
            raise (RuntimeError if plan.call_order else ValueError)(plan.refusal)
        if plan.check_peft:
            # PEFT owns the embedding and the head: only a base model untied before wrapping can train here.
            check_peft_run(
                model, tied=is_tied(model), untie_recorded=untie_recorded(model), keep_untied=plan.keep_untied
            )
            return
        if plan.warning is not None:
            _compat.warn_in_user_code(plan.warning)
        if plan.untie_reason is not None:
            self.planned_untie_reason = plan.untie_reason
        current = structure_of(model, emulating=self.emulation is not None)
        if plan.target == "untied":
            self._reach_untied(model, current, optimizer)
        elif plan.target == "tied" and current == "untied":
            tie_embeddings(model, init=plan.tie_init)
        elif plan.target == "emulated" and current != "emulated":
            if current == "untied":
                tie_embeddings(model, init=plan.tie_init)  # the other matrix is dropped, as for a live tied phase
            untie_embeddings(model)  # the head gets its own parameter now, before wrapping, and trains as if tied
            if self.tying_mode == "live":
                logger.info("untie: the checkpoint was written with emulated tying; this run resumes it emulated.")
            self.tying_mode = "emulated"
            # ZeRO reduces and partitions gradients inside backward (no point to fold them): tie in autograd there.
            self.emulation = ZeroTying(model) if self.engine == "DEEPSPEED" else EmulatedTying(model)

    def _reach_untied(self, model: nn.Module, current: str, optimizer) -> None:
        if current == "emulated":  # the head has had its own parameter, in the optimizer, from the start
            self.emulation.release()
            self.emulation = None
        elif current == "tied" or optimizer is None:
            # On an untied model (a reloaded untie, untie_at=0) this re-applies the bookkeeping a reload loses. A
            # resumed run's head gets its optimizer state from the checkpoint, loaded next.
            untie_embeddings(model, optimizer, optimizer_state="reset")
            if optimizer is not None:
                self.install_grad_sync(model)
        else:  # untied before this resume (untie_at=0, or the model's state dict loaded first): the head must train
            head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
            if not any(p is head for group in inner_optimizer(optimizer).param_groups for p in group["params"]):
                add_param_like(optimizer, new=head, like=embedding, state="reset")
                self.install_grad_sync(model)

    # -- run state ----------------------------------------------------------------------------------------------------
    @property
    def trigger_state(self) -> dict | None:
        """The divergence trigger's running state (average, streak, firing step); None without a trigger."""
        return self.divergence.state_dict() if self.divergence is not None else None

    @trigger_state.setter
    def trigger_state(self, value: dict | None) -> None:
        if self.divergence is not None and value:
            self.divergence.load_state_dict(value)

    def state_dict(self, step: int, weights: dict | None = None) -> dict:
        """The run state at optimizer step `step`, JSON-able, in the one layout both adapters save
        (`untie.saved_state`): the settings, the tied phase's implementation, the untie and the trigger, the history,
        and the weights' fingerprint (`weights`, None where the adapter's framework saves a folder as a whole)."""
        return {
            "format": STATE_FORMAT,
            "adapter": self.adapter.name,
            "global_step": step,
            "tying_mode": self.tying_mode,
            "config": self.config.to_json_dict(),
            "attributes": self.state_attributes(),
            "weights": weights,
        }

    def load_state_dict(self, state: dict, where: str, step: int | None = None) -> dict:
        """Restore the run state `state_dict` saved (checked first: a damaged state raises
        `untie.saved_state.UntieStateError` naming `where`), as of optimizer step `step` (default: the saved step),
        and say which schedule settings changed. Returns the checked state. The model's structure is the plan's
        (`match_saved`), applied before the weights load."""
        state = check_state(state, where)
        step = state["global_step"] if step is None else step
        self.restore(state["attributes"], step)
        self.warn_changed_settings(state["config"], step)
        return state

    def state_attributes(self) -> dict:
        """The run state a checkpoint keeps, as JSON-able values (read back by `restore`)."""
        return {name: getattr(self, name) for name in SAVED_ATTRIBUTES}

    def restore(self, attributes: dict, step: int) -> None:
        """Start this run's state: a checkpoint's (`state_attributes`, saved at `step`) or fresh ({}, step 0).

        The trigger starts anew from the settings either way, so a run object used for a second run (Trainer's
        train() called again) carries nothing over.
        """
        self.history = [h for h in attributes.get("history", []) if h["step"] <= step]
        self.divergence = DivergenceTrigger(self.rule) if self.rule else None
        self.trigger_state = attributes.get("trigger_state")
        self.untied = bool(attributes.get("untied"))
        self.untie_step = attributes.get("untie_step") if self.untied else None
        self.untie_reason = attributes.get("untie_reason") if self.untied else None
        self.latest, self._unmeasured_warned = {}, False

    def warn_changed_settings(self, saved_config: dict, step: int) -> None:
        """Say which schedule settings differ from the checkpoint's run (`saved_config`, as JSON), and what they do."""
        now = self.config.to_json_dict()
        changed = [
            k for k in ("untie_at", "untie_when") if k in saved_config and not self._same(k, saved_config[k], now[k])
        ]
        if not changed:
            return
        what = ", ".join(f"{k}: {saved_config[k]!r} -> {now[k]!r}" for k in changed)
        if self.untied:
            _compat.warn_in_user_code(
                f"{self.owner}: resumed with changed settings ({what}), which have no effect: the checkpoint's run "
                f"untied at step {self.untie_step} ({self.untie_reason}) and a resumed run does not re-tie."
            )
        else:
            _compat.warn_in_user_code(
                f"{self.owner}: resumed at step {step} with changed settings ({what}); the tied run continues under "
                "the new ones (a deadline already passed unties at the resume step)."
            )

    def _same(self, key: str, saved, now) -> bool:
        """Whether a checkpoint's setting (JSON) is this run's (`now`); rules compare by what they resolve to."""
        if key != "untie_when":
            return saved == now
        try:
            then = UntieWhen.coerce(saved, with_pairs=bool(self.pairs))
        except (TypeError, ValueError):
            return False
        return (then and then.to_dict()) == (self.rule and self.rule.to_dict())

    # -- the run ------------------------------------------------------------------------------------------------------
    def begin(self, model: nn.Module, optimizer, step: int, max_steps: int | None) -> None:
        """Start training at optimizer step `step` of `max_steps`: untie at a deadline already reached, else set up
        the measurements. The model is prepared and any checkpoint is loaded. It says nothing: `announce` does, once
        the adapter knows which run begins (`Untier` begins a fresh run at `start` and, when a checkpoint loads before
        the first step, the resumed one in its place)."""
        self.deadline.resolve(max_steps)
        if self.divergence is not None:
            self.divergence.resolve(max_steps)
        self.drop_probe()
        if self.emulation is not None:
            self._begin_emulated(model, optimizer, step, max_steps)
            return
        if not is_tied(model):
            # Untied before training: at step 0, or by the resume guard while loading an untied checkpoint.
            reason = self.untie_reason or self.planned_untie_reason or ("checkpoint" if step else "start")
            self._record_untie(self.untie_step if self.untie_step is not None else step, reason)
        elif self.untied:
            raise RuntimeError(
                f"{self.owner}: the checkpoint state says the model was untied, but the model is tied. Resume with "
                "the same model class, or call untie.prepare_for_resume(model, checkpoint_dir) before loading it."
            )
        elif self.deadline.fires(step):
            self.untie(model, optimizer, step, "deadline")
        elif self.config.metrics_every:
            self.probe = RoleGradientProbe(model, pairs=self.pairs)

    def _begin_emulated(self, model: nn.Module, optimizer, step: int, max_steps: int | None) -> None:
        if self.untied:  # resumed from a checkpoint saved after the untie: the head's values and state are its own
            self.emulation.release()
            self.emulation = None
            return
        self.emulation.attach_optimizer(optimizer)
        if self.deadline.fires(step):
            self.untie(model, optimizer, step, "deadline")
        elif self.config.metrics_every:
            # A measurement costs O(|T| d) per rank (the rows the batch looked up), also sharded: the trigger stays on.
            self.probe = RoleGradientProbe(model, pairs=self.pairs, emulation=self.emulation)

    def announce(self, step: int, max_steps: int | None) -> None:
        """Say what the user should know about the run that `begin` set up at `step`, before its first step runs (a
        trigger that cannot fire in the run's length). Call it once per begun run, after the last `begin`."""
        if self.probe is not None:
            self._warn_short_run(step, max_steps)

    def arm(self, step: int) -> None:
        """Optimizer step `step` is about to run its first forward: measure its gradients if it is a metrics step."""
        if self.probe is not None:
            self.probe.armed = self.measures(step)

    def measure(self, step: int) -> None:
        """Optimizer step `step`'s gradients are complete (all micro-batches, all ranks): read the role signals off
        them and feed the trigger. Every rank must call it."""
        if self.probe is None or not self.probe.armed:
            return
        self.probe.armed = False
        grads = self.probe.collect()
        if grads is None:
            self._warn_unmeasured()
            return
        signals = role_signals_on_rows(grads, pairs=self.pairs)
        signals.update(self.probe.pair_measurements(grads))
        if self.divergence is not None:
            self.divergence.update(step, signals)
            signals["trigger"] = self.divergence.average if self.divergence.average is not None else math.nan
        self._record(step, signals)

    def end_of_step(self, model: nn.Module, optimizer, step: int) -> str | None:
        """Optimizer step `step` is done: untie if the trigger fired or the deadline is reached (returns why), or
        measure the drift of an untied model. Every rank must call it."""
        if self.untied:
            if self.measures(step):
                self._record(step, self._drift(model, step))
            return None
        reason = None
        if self.divergence is not None and self.measures(step):
            # Every rank takes rank 0's decision, at the same step.
            if broadcast_decision(self.divergence.fired_step is not None):
                reason = "trigger"
        if reason is None and self.deadline.fires(step):
            reason = "deadline"
        if reason is not None:
            self.untie(model, optimizer, step, reason)
        return reason

    def untie(self, model: nn.Module, optimizer, step: int, reason: str) -> None:
        """Untie now, between optimizer steps, with the optimizer state of `config.optimizer_state`."""
        self.drop_probe()
        if self.emulation is not None:
            # The head has existed (and been wrapped) from the start: the untie only stops keeping it equal.
            self.emulation.release(optimizer, optimizer_state=self.config.optimizer_state)
            self.emulation = None
        else:
            untie_embeddings(model, optimizer, optimizer_state=self.config.optimizer_state)
            self.install_grad_sync(model)
        self._record_untie(step, reason)
        logger.info("untie: untied the LM head from the input embedding at step %d (%s)", step, reason)

    def install_grad_sync(self, model: nn.Module) -> None:
        """Average the head's gradient over ranks: a head created after DDP wrapped the model is not reduced by DDP."""
        if self._grad_sync_handle is None:
            self._grad_sync_handle = sync_grads_across_ranks(model.get_output_embeddings().weight)

    def close(self) -> None:
        """Take every hook off (the run is over)."""
        if self._grad_sync_handle is not None:
            self._grad_sync_handle.remove()
            self._grad_sync_handle = None
        self.drop_probe()
        if self.emulation is not None:  # a run that ends tied: the optimizer is the run's, its hooks go with it
            self.emulation.detach_optimizer()

    def take_latest(self) -> dict[str, float]:
        """The `untie/*` values to log now: the tying state and the last measurement (once). A value the run has not
        measured (a pair whose symbol has not occurred yet, the trigger before its first average: NaN in `history`)
        is absent, not logged as NaN."""
        logs = {"untie/tied": 0.0 if self.untied else 1.0}
        if self.untie_step is not None:
            logs["untie/untie_step"] = self.untie_step
        logs.update({f"untie/{k}": v for k, v in self.latest.items() if not math.isnan(v)})
        self.latest = {}
        return logs

    # -- helpers ------------------------------------------------------------------------------------------------------
    def measures(self, step: int) -> bool:
        every = self.config.metrics_every
        return every > 0 and step > 0 and step % every == 0

    def drop_probe(self) -> None:
        if self.probe is not None:
            self.probe.remove()
            self.probe = None

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        self.latest = summarize_pair_metrics(metrics)  # the history keeps every pair

    def _drift(self, model: nn.Module, step: int) -> dict[str, float]:
        input_weight = model.get_input_embeddings().weight
        output_weight = model.get_output_embeddings().weight
        if not is_sharded(input_weight):
            with gathered(input_weight, output_weight):  # ZeRO-3: every rank gathers both, then measures the same
                return drift_metrics(input_weight, output_weight, pairs=self.pairs, seed=step, **_DRIFT_SAMPLE)
        # FSDP2: read only the sampled rows of each rank's shard (every rank samples the same rows).
        return sampled_drift_metrics(
            lambda ids: (gather_rows(input_weight, ids), gather_rows(output_weight, ids)),
            vocab=full_shape(input_weight)[0],
            pairs=self.pairs,
            seed=step,
            **_DRIFT_SAMPLE,
        )

    def _record_untie(self, step: int, reason: str) -> None:
        self.untied = True
        if self.untie_step is None:
            self.untie_step = step
            self.untie_reason = reason

    def _warn_short_run(self, step: int, max_steps: int | None) -> None:
        """Say once when `metrics_every` leaves the trigger too few measurements before the deadline (or the run's
        end) to fire, or leaves no measurement at all: a short fine-tune with the defaults would otherwise be a plain
        schedule without a word."""
        every, last = self.config.metrics_every, self.deadline.step or max_steps
        if last is None:  # an open-ended custom loop: nothing to count against
            return
        if self.divergence is not None:
            chances, needed = self.divergence.chances(every, last), self.divergence.rule.patience
            if chances >= needed:
                return
            fit = max(1, (last - max(self.divergence.warmup_step, 1) + 1) // needed)
            what = f"the model unties at the deadline, step {last}" if self.deadline.step else "the model stays tied"
            _compat.warn_in_user_code(
                f"{self.owner}: metrics_every={every} leaves the divergence trigger {chances} measurement(s) after "
                f"its warm-up (step {self.divergence.warmup_step}) and by step {last}; it needs {needed} in a row to "
                f"fire, so it cannot fire and {what}. Pass metrics_every <= {fit} to give it a chance, or "
                "untie_when=None for a plain schedule at untie_at."
            )
        elif every > last - step:  # no trigger reads them: a note, not a warning
            logger.info(
                "untie: metrics_every=%d measures nothing by step %d (the %s); pass a smaller metrics_every to see the "
                "role signals, or metrics_every=0 to turn them off.",
                every,
                last,
                "untie" if self.deadline.step else "end of the run",
            )

    def _warn_unmeasured(self) -> None:
        if not self._unmeasured_warned:
            self._unmeasured_warned = True
            _compat.warn_in_user_code(
                f"{self.owner}: a measurement step ran no backward through the tied matrix's two roles, so the role "
                "signals (and the divergence trigger, which then waits for the deadline) are missing. Is the matrix "
                "frozen? Under torch.compile, module hooks added after a model of the same class was compiled in "
                "this process are not traced (torch._dynamo.config.skip_nnmodule_hook_guards): call "
                "torch._dynamo.reset() before building the Trainer."
            )


def structure_of(model: nn.Module, emulating: bool = False) -> Structure:
    """The model's structure (`untie.plan`): "emulated" while a run keeps its separate head equal (`emulating`)."""
    if emulating:
        return "emulated"
    return "tied" if is_tied(model) else "untied"


def model_facts(model: nn.Module, *, emulating: bool = False, optimizer_built: bool = False) -> ModelFacts:
    """What `plan_structure` needs to know about `model`."""
    peft = is_peft_model(model)
    return ModelFacts(
        structure=structure_of(model, emulating),
        marked_untied=was_untied(model),
        peft=peft,
        config_says_untied=peft and untie_recorded(model),
        optimizer_built=optimizer_built,
    )
