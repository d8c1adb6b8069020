"""The tied phase under DeepSpeed ZeRO 1-3: tying in autograd (`ZeroTying`), and the untie through DeepSpeed's API.

ZeRO builds its flat fp32 partitions at engine init, so the head must have its own parameter from the start (as for
FSDP2's `untie.engines.emulation.EmulatedTying`). The FSDP2 emulation's gradient fold does not fit ZeRO: ZeRO reduces
and partitions each gradient inside backward, and under accelerate the engine steps inside backward too, so there is no
point between backward and the step to fold anything. Here the tie happens in autograd instead. While tied, the lookup
and the head both read the embedding's values through `_TiedPair`, whose backward hands each matrix the tied gradient
divided by sqrt(2):

* both matrices start equal, receive the same gradient and the same (empty) optimizer state, so they take identical
  steps: the head's parameter, its fp32 master copy and its optimizer moments equal the embedding's at every step.
  Every checkpoint (Trainer's `checkpoint-N/global_stepN`, `engine.save_checkpoint`, `accelerator.save_state`,
  `zero_to_fp32`, a final save) holds a right head as it is, and resumes with the same set of parameters before and
  after the untie;
* the global gradient norm, hence clipping, is exactly live tying's: 2 * |g / sqrt(2)|^2 = |g|^2;
* weight decay (AdamW's, decoupled) shrinks both copies as it shrinks the shared matrix;
* Adam-family steps do not depend on the gradient's scale, but for eps: a step is m / (sqrt(v) + sqrt(2) * eps) in
  live terms, i.e. eps is effectively sqrt(2) times larger on these two matrices (1.4e-8 for the default 1e-8). Their
  moments are live tying's scaled by 1/sqrt(2) (first) and 1/2 (second), so the untie rescales them (`release`).
  Optimizers whose step scales with the gradient (SGD, Adafactor's relative steps aside) would take sqrt(2)-smaller
  steps: `check_optimizer` refuses them.

The cost while tied is that of an untied model: the head's parameter, gradient, fp32 master and moments.

`W.grad` never holds the step's tied gradient under ZeRO, and under accelerate the engine steps inside backward, so
the role-gradient probe (the divergence trigger) reads it here: the tying wraps the step of DeepSpeed's optimizer
(`attach_optimizer`), and on a measuring step calls the probe there, before the step, when ZeRO holds the gradient
reduced (averaged over ranks) and not yet clipped; `read_tied_rows` reads the rows the probe needs from this rank's
part of it, with one (rows, d) all-reduce and one scalar. The lookup hands the probe the rows of W the step reads,
before the engine steps. A measuring step holds O(rows read x d) more than a plain one, as under DDP and FSDP2.

DeepSpeed's public API does the rest: `deepspeed.zero.register_external_parameter` tells ZeRO-3 that each of the two
modules reads the other's parameter (so both are gathered for its forward and backward), and
`deepspeed.utils.safe_get_full_optimizer_state` / `safe_set_full_optimizer_state` rescale the moments on every stage.
Checked: deepspeed 0.19.8 (ZeRO-1, 2 and 3 on 2 CPU ranks, gloo; `tests/test_deepspeed.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from untie import _compat
from untie.distributed import full_shape
from untie.engines.emulation import separate_roles
from untie.errors import UntieValueError
from untie.registry import Registry

#: Elements of a gradient part whose squared norm is summed at once in float64 (32 MiB of float64).
_NORM_CHUNK = 1 << 22
#: Adam-family state entries and the power of the gradient's scale they carry.
ADAM_MOMENTS = {"exp_avg": 1, "exp_avg_sq": 2}


class _TiedPair(torch.autograd.Function):
    """Forward: the embedding's values. Backward: the gradient divided by sqrt(2), to both matrices."""

    @staticmethod
    def forward(ctx, embedding: torch.Tensor, head: torch.Tensor, tying: ZeroTying) -> torch.Tensor:
        ctx.tying = tying
        return embedding.view_as(embedding)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        grad = grad / math.sqrt(2.0)
        return grad, grad, None


def _wrapped(optimizer) -> Iterator:
    """`optimizer` and the optimizers it wraps, outermost first: accelerate's wrapper -> DeepSpeed's optimizer (ZeRO's,
    or its bf16 / fp16 one) -> the torch optimizer it steps."""
    inner = optimizer
    for _ in range(4):
        yield inner
        nested = getattr(inner, "optimizer", None)
        if nested is None or nested is inner:
            return
        inner = nested


def deepspeed_optimizer(optimizer):
    """DeepSpeed's own optimizer (ZeRO's, or its bf16 / fp16 wrapper: what its engine steps) inside accelerate's
    wrappers, or None (the engine steps the client optimizer: ZeRO stage 0)."""
    ours = (inner for inner in _wrapped(optimizer) if type(inner).__module__.startswith("deepspeed.runtime"))
    return next(ours, None)


def zero_stage(param: torch.Tensor) -> int | None:
    """3 for a ZeRO-3 partitioned parameter, 1/2 for one a ZeRO-1/2 optimizer maps, None for a plain parameter."""
    if _compat.is_deepspeed_partitioned(param):
        return 3
    return 2 if _compat.is_deepspeed_mapped(param) else None


def check_optimizer(optimizer) -> None:
    """Refuse an optimizer whose step is not invariant to the gradient's scale: `ZeroTying` feeds each matrix the
    tied gradient divided by sqrt(2), which only the Adam family (Adam, AdamW, DeepSpeed's FusedAdam and CPUAdam)
    turns into the tied step."""
    for inner in _wrapped(optimizer):
        if "adam" in type(inner).__name__.lower() and "zero" not in type(inner).__name__.lower():
            return
    raise UntieValueError(
        f"untie under DeepSpeed ties the two roles in autograd, which trains exactly as tied only with an Adam-family "
        f"optimizer (Adam, AdamW, DeepSpeed's FusedAdam / CPUAdam); this run's is {type(inner).__name__}. Use AdamW "
        "(Trainer's default optim), or train with DDP or FSDP2, where any optimizer works."
    )


class ZeroTying:
    """Keeps an untied model's LM head equal to its input embedding under DeepSpeed ZeRO, with the tied gradient and
    the tied clipping norm, until `release()` (see the module docstring).

    Create it on the plain model whose head already has its own parameter (`untie.untie_embeddings`), before
    `deepspeed.initialize` / `accelerator.prepare`; call `attach_optimizer` once the engine exists. The same interface
    as `untie.engines.emulation.EmulatedTying`, so `untie.core.run.UntieRun` drives either.
    """

    reads_at_step = True
    """ZeRO steps inside backward: the tied gradient is read at the optimizer step (`listen`, `read_tied_rows`)."""

    def __init__(self, model: nn.Module, registry: Registry | None = None) -> None:
        self.embedding: Any
        self.head: Any
        self.embedding, self.head = separate_roles(model, "ZeroTying")
        if not isinstance(self.embedding, nn.Embedding) or not isinstance(self.head, nn.Linear):
            raise UntieValueError(
                f"untie under DeepSpeed ties an nn.Embedding lookup and an nn.Linear head; this model's are "
                f"{type(self.embedding).__name__} and {type(self.head).__name__}. Train it with DDP or FSDP2."
            )
        self.active = True
        self.after_fold: list = []  # the interface of EmulatedTying (its probe listens there; this one's is below)
        self.capture_if: Callable[[], bool]
        """Whether this is a measuring step (set by `untie.signals.probe.RoleGradientProbe`)."""
        self.on_capture_lookup: Callable[[torch.Tensor, torch.Tensor], None]
        """Called with each measuring step's input ids and the (gathered) matrix, before the step changes it."""
        self.on_optimizer_step: Callable[[], None]
        """Called on a measuring step at DeepSpeed's optimizer step, before it: the gradient is reduced, not clipped."""
        self.stop_listening()
        #: Every install (the two forwards, ZeRO-3's external parameters), with its removal: a child of the run's
        #: registry, so that closing the run closes it.
        self.registry = registry.child("ZeRO tying") if registry is not None else Registry("ZeRO tying")
        self._external_registered = False
        self._on_optimizer: Registry | None = None
        """The step wrapper of `attach_optimizer` (None while detached)."""
        embedding, head = self.embedding, self.head

        def tied_lookup(input_ids: torch.Tensor) -> torch.Tensor:
            if self.capture_if():  # the matrix as this step reads it (DeepSpeed steps before the probe collects)
                self.on_capture_lookup(input_ids, embedding.weight)
            weight = _TiedPair.apply(embedding.weight, head.weight, self)
            return F.embedding(
                input_ids,
                weight,
                embedding.padding_idx,
                embedding.max_norm,
                embedding.norm_type,
                embedding.scale_grad_by_freq,
                embedding.sparse,
            )

        def tied_head(hidden: torch.Tensor) -> torch.Tensor:
            return F.linear(hidden, _TiedPair.apply(embedding.weight, head.weight, self), head.bias)

        # Instance attributes over the modules' own forward; the removal puts back what each module held before (a
        # forward accelerate's `add_hook_to_module` set there, say), and only while ours is still in place.
        self.registry.replace("ZeRO tying: tied lookup forward", embedding, "forward", tied_lookup)
        self.registry.replace("ZeRO tying: tied head forward", head, "forward", tied_head)

    def listen(
        self,
        capture_if: Callable[[], bool],
        on_capture_lookup: Callable[[torch.Tensor, torch.Tensor], None],
        on_optimizer_step: Callable[[], None],
    ) -> None:
        """Let a probe measure: the three listeners below (`stop_listening` takes them off)."""
        self.capture_if, self.on_capture_lookup, self.on_optimizer_step = (
            capture_if,
            on_capture_lookup,
            on_optimizer_step,
        )

    def stop_listening(self) -> None:
        """No probe listens: no step measures (the probe sets the three listeners, and calls this when removed)."""
        self.capture_if = lambda: False
        self.on_capture_lookup = lambda ids, weight: None
        self.on_optimizer_step = lambda: None

    def read_tied_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tied gradient's rows `ids` (sorted, the same on every rank) as a (len(ids), d) float32 tensor, and its
        whole squared norm (float64), from ZeRO's reduced gradient of the embedding (the tied gradient / sqrt(2)).
        Call it at DeepSpeed's optimizer step, before the step (`on_optimizer_step`); every rank must call it.

        Each rank reads the rows that fall in its part of the gradient; one (len(ids), d) all-reduce assembles them
        and one scalar all-reduce sums the norm: no (V, d) buffer on any rank."""
        weight = self.embedding.weight
        width = full_shape(weight)[1]
        rows = torch.zeros(len(ids), width, dtype=torch.float32, device=ids.device)
        sq_norm = torch.zeros(1, dtype=torch.float64, device=ids.device)
        values, start = _compat.deepspeed_local_grad(weight) or (torch.empty(0), 0)
        if values.numel():
            values = values.reshape(-1)
            for chunk in values.split(_NORM_CHUNK):  # float64 sums, never a float64 copy of the whole part
                sq_norm += torch.linalg.vector_norm(chunk, dtype=torch.float64).square().to(ids.device)
            elements = ids.to(values.device).unsqueeze(1) * width + torch.arange(width, device=values.device) - start
            held = (elements >= 0) & (elements < values.numel())
            picked = values[elements.clamp(0, values.numel() - 1)].float()
            rows += torch.where(held, picked, torch.zeros((), device=values.device)).to(rows.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(rows, op=dist.ReduceOp.SUM)
            dist.all_reduce(sq_norm, op=dist.ReduceOp.SUM)
        return rows * math.sqrt(2.0), 2.0 * sq_norm[0]

    def attach_optimizer(self, optimizer) -> None:
        """The engine exists: check the optimizer, wrap the step of DeepSpeed's optimizer (where a measuring step is
        read), and under ZeRO-3 tell DeepSpeed that each module reads the other's parameter (idempotent: a resumed run
        attaches again)."""
        check_optimizer(optimizer)
        self._wrap_step(optimizer)
        if _compat.is_deepspeed_partitioned(self.embedding.weight) and not self._external_registered:
            import deepspeed

            # Public in deepspeed.runtime.zero.partition_parameters, not re-exported by deepspeed.zero (0.19.8).
            from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

            for module, param in ((self.head, self.embedding.weight), (self.embedding, self.head.weight)):
                deepspeed.zero.register_external_parameter(module, param)
                removal = functools.partial(unregister_external_parameter, module, param)
                self.registry.add("ZeRO tying: external parameter (ZeRO-3)", removal)
            self._external_registered = True

    def release(self, optimizer=None, optimizer_state: str = "copy") -> None:
        """Untie between optimizer steps, on every rank: each module reads its own parameter again.

        With `optimizer` (an untie now, not a run resumed after one), the moments become the untied run's: both
        matrices' are the live tied ones once rescaled (`"copy"`); `"reset"` zeroes the head's, `"fresh"` both. ZeRO
        keeps one step count per flat group, so a zeroed moment is not bias-corrected as a new parameter's would be:
        its first steps are smaller (by 1 - beta1^k at the k-th), a short built-in warm-up.
        """
        self.active = False
        self.remove()
        if optimizer is None:
            return
        zeroed = {"copy": (), "reset": (self.head.weight,), "fresh": (self.head.weight, self.embedding.weight)}
        for key, power in ADAM_MOMENTS.items():
            for param in (self.embedding.weight, self.head.weight):
                value = _full_state(optimizer, param, key)
                if value is None:  # no step yet: nothing to rescale
                    continue
                if any(param is p for p in zeroed[optimizer_state]):
                    value = torch.zeros_like(value)
                else:
                    value = value * math.sqrt(2.0) ** power
                _set_full_state(optimizer, param, key, value)

    def _wrap_step(self, optimizer) -> None:
        """Call `on_optimizer_step` at the step of DeepSpeed's optimizer on measuring steps, before the step (its
        engine calls that step inside backward under accelerate, and only at a gradient-accumulation boundary)."""
        if self._on_optimizer is not None:
            return
        stepper = deepspeed_optimizer(optimizer)
        if stepper is None:
            return
        original = stepper.step

        def step(*args, **kwargs):
            if self.capture_if():
                self.on_optimizer_step()
            return original(*args, **kwargs)

        self._on_optimizer = self.registry.child("optimizer")
        self._on_optimizer.replace("ZeRO tying: DeepSpeed optimizer step wrapper", stepper, "step", step)

    def remove(self) -> None:
        """Each module reads its own parameter again; ZeRO-3 stops gathering the other's; DeepSpeed's optimizer steps
        as before (only this tying's own replacements are removed: one someone set on top stays)."""
        self.registry.close()
        self._on_optimizer = None
        self._external_registered = False

    def detach_optimizer(self) -> None:
        """DeepSpeed's optimizer steps as before `attach_optimizer` (the run is over; `attach_optimizer` wraps it
        again). Only this tying's own wrapper comes off: one someone set on top of it stays."""
        if self._on_optimizer is not None:
            self._on_optimizer.close()
            self._on_optimizer = None


def _torch_optimizer_holding(optimizer, param: torch.Tensor) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's and DeepSpeed's wrappers whose state is keyed by `param` (ZeRO stage 0,
    where the engine steps the client optimizer on the model's own parameters)."""
    holders = (inner for inner in _wrapped(optimizer) if isinstance(inner, torch.optim.Optimizer))
    return next((inner for inner in holders if param in inner.state), None)


def _full_state(optimizer, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """`param`'s full optimizer state entry `key` on every rank (a collective under ZeRO 1-3), None if it has none."""
    if zero_stage(param) is not None:
        from deepspeed.utils import safe_get_full_optimizer_state

        return safe_get_full_optimizer_state(param, key)
    holder = _torch_optimizer_holding(optimizer, param)
    return None if holder is None else holder.state[param].get(key)


def _set_full_state(optimizer, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
    if zero_stage(param) is not None:
        from deepspeed.utils import safe_set_full_optimizer_state

        safe_set_full_optimizer_state(param, value, key)
    else:
        holder = _torch_optimizer_holding(optimizer, param)
        assert holder is not None, "no optimizer holds the parameter's state"
        holder.state[param][key].copy_(value)
