"""Every touch of a transformers / accelerate / torch internal, in one place, with the versions it was checked on.

The rest of the library calls these functions instead of reaching into private names, so an upstream change is
fixed here once. Each entry says what it touches, why no public API does the job, and the versions it was checked
on.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch import nn

from untie.errors import UntieValueError

# -- transformers: tied-weights declarations ---------------------------------------------------------------------------
# `PreTrainedModel._tied_weights_keys` (class attribute, {target: source} since transformers 5.0) declares the ties
# that `tie_weights()` re-applies; `all_tied_weights_keys` is its expanded per-instance cache, rebuilt by
# `get_expanded_tied_weights_keys(all_submodels=True)`. No public API removes one entry (the head's) from an
# instance; the untie sets an instance-level mapping without it. Checked: transformers 5.12.1 and 5.23.0 (CI).
TIED_KEYS_ATTR = "_tied_weights_keys"


def class_tied_keys(module: nn.Module) -> dict[str, str] | None:
    """The tied-weights mapping the module's class declares ({target: source}), ignoring instance overrides."""
    keys = getattr(type(module), TIED_KEYS_ATTR, None)
    return keys if isinstance(keys, dict) else None


def tied_keys(module: nn.Module) -> dict[str, str] | None:
    """The tied-weights mapping in effect on the module (an instance override first, else the class's)."""
    keys = getattr(module, TIED_KEYS_ATTR, None)
    return keys if isinstance(keys, dict) else None


def set_instance_tied_keys(module: nn.Module, keys: dict[str, str]) -> None:
    """Override the module's tied-weights mapping on this instance only (the class keeps its declaration)."""
    setattr(module, TIED_KEYS_ATTR, keys)


def clear_instance_tied_keys(module: nn.Module) -> None:
    """Drop an instance override: the class's declaration applies again."""
    if TIED_KEYS_ATTR in vars(module):
        delattr(module, TIED_KEYS_ATTR)


def refresh_tied_keys_cache(model: nn.Module) -> None:
    """Rebuild `model.all_tied_weights_keys` after the mapping changed (what `save_pretrained` / loading read)."""
    if hasattr(model, "get_expanded_tied_weights_keys"):
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)  # type: ignore[operator]  # undeclared upstream attribute


def expanded_tied_keys(model: nn.Module) -> set[str]:
    """The names of the parameters that loading fills by tying (`all_tied_weights_keys`), empty if unknown."""
    return set(getattr(model, "all_tied_weights_keys", None) or {})


# -- transformers: model classes ---------------------------------------------------------------------------------------
def build_from_config(model_class: type, config: Any) -> nn.Module:
    """`model_class._from_config(config)`: a model built from its config without loading weights (the public
    `AutoModel*.from_config` needs an Auto class; this builds any class, e.g. on the meta device).
    Checked: transformers 5.12.1 and 5.23.0 (CI)."""
    return model_class._from_config(config)  # type: ignore[attr-defined]  # undeclared upstream attribute


def init_module_weights(model: nn.Module, module: nn.Module) -> None:
    """`model._init_weights(module)`: draw `module`'s parameters as the model's own initialiser does (no public API
    initialises one submodule; `post_init` redoes the whole model). Checked: transformers 5.24.0, on the heads of the
    9 tiny architectures of `untie.testing` (a new parameter carries no `_is_hf_initialized` flag, so it is drawn);
    CI's oldest step runs tests/test_policy.py on 5.12.1."""
    model._init_weights(module)  # type: ignore[operator]  # undeclared upstream attribute


def has_initialiser(model: nn.Module) -> bool:
    """Whether `model` has transformers' per-module initialiser (`_init_weights`, which `init_module_weights`
    calls). Checked: transformers 5.24.0 (CI's oldest step: 5.12.1)."""
    return callable(getattr(model, "_init_weights", None))


def loaded_from(model: nn.Module) -> str:
    """Where `from_pretrained` loaded `model` from: its config's `_name_or_path` (the public `model.name_or_path`
    reads the same), "" for a model built from a config. Checked: transformers 5.24.0 (CI's oldest step: 5.12.1)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "")


def loss_alignment(model: nn.Module) -> str | None:
    """How the model's logits meet its labels: "shifted" (position t predicts label t + 1: a causal LM) or "aligned"
    (position t predicts label t: masked and sequence-to-sequence LMs); None where unknown. Read off
    `PreTrainedModel.loss_type` (public, but undocumented: None for classes such as GPT2LMHeadModel, whose
    `loss_function` then falls back to the causal loss; only a class of the causal-LM auto mapping is taken as causal
    then). Checked: transformers 5.24.0 (CI's oldest step: 5.12.1)."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type == "ForCausalLM":
        return "shifted"
    if loss_type in ("ForMaskedLM", "ForConditionalGeneration"):
        return "aligned"
    if loss_type is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
            return "shifted"
    return None


def auto_class_mapping(auto_class: type) -> Any:
    """`AutoModel*._model_mapping`: {config class: model class}, to find a checkpoint's head class without building
    it (no public lookup exists). Checked: transformers 5.12.1 and 5.23.0 (CI)."""
    return auto_class._model_mapping  # type: ignore[attr-defined]  # undeclared upstream attribute


# -- transformers: Trainer's callback handler --------------------------------------------------------------------------
def find_caller(accept: Callable[[Any], bool], skip: int = 2, depth: int = 8) -> Any:
    """The nearest `self` among the calling frames (from `skip` frames up) that `accept` takes, or None.

    Trainer hands callbacks neither itself nor its `CallbackHandler`; `on_init_end` needs both (to refuse a second
    UntieCallback, to run first, to wrap `model_init` and `train`). Frame walking is CPython behaviour
    (`sys._getframe`); the callers are `CallbackHandler.call_event` and `Trainer.__init__`. Checked:
    transformers 5.12.1 and 5.23.0 (CI) on CPython 3.11.
    """
    frame: FrameType | None = sys._getframe(skip)
    for _ in range(depth):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if accept(caller):
            return caller
        frame = frame.f_back
    return None


def holds_callback(handler: Any, callback: Any) -> bool:
    """Whether `handler` is Trainer's `CallbackHandler` (`transformers.trainer_callback.CallbackHandler`, not part of
    the documented API: Trainer builds it and keeps it private) and its callback list holds `callback`. Checked:
    transformers 5.12.1 and 5.23.0 (CI)."""
    from transformers.trainer_callback import CallbackHandler

    return isinstance(handler, CallbackHandler) and callback in handler.callbacks


#: Packages whose frames a warning skips to reach the user's line: the library and the frameworks that call it.
LIBRARY_PACKAGES = frozenset({"untie", "transformers", "accelerate", "torch", "peft"})


def warn_in_user_code(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the first calling frame outside the library and the frameworks that call it
    (Trainer's event loop, accelerate's hooks), however deep the call: the line the user wrote, which no fixed
    `stacklevel` finds from both adapters. Frame walking is CPython behaviour (`sys._getframe`); `skip_file_prefixes`
    does the same from Python 3.12 only. Checked: CPython 3.10-3.13."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # level 1 is this function, 2 its caller
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in LIBRARY_PACKAGES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def move_callback_first(handler: Any, callback: Any) -> None:
    """Put `callback` first in `CallbackHandler.callbacks` (a plain list; the public `add_callback` appends):
    Trainer adds the reporting integrations before user callbacks, and `untie/*` keys added in `on_log` must reach
    them. Checked: transformers 5.12.1 and 5.23.0 (CI)."""
    handler.callbacks.remove(callback)
    handler.callbacks.insert(0, callback)


# -- accelerate: whether a PartialState exists -------------------------------------------------------------------------
def partial_state_exists() -> bool:
    """Whether accelerate's `PartialState` was initialised in this process, without initialising it.

    The public `accelerate.state.is_initialized()` answers for `AcceleratorState` (an `Accelerator`), and
    `PartialState().initialized` would create the state it asks about: read the borg class's shared state dict.
    Checked: accelerate 1.13.0 and 1.15.0 (CI).
    """
    from accelerate.state import PartialState

    return bool(PartialState._shared_state)


def is_accelerated_optimizer(optimizer: object) -> bool:
    """Whether `optimizer` is what `accelerator.prepare` returns for an optimizer (`AcceleratedOptimizer`, DeepSpeed's
    wrapper included: a subclass). Checked: accelerate 1.13.0 and 1.15.0 (CI)."""
    from accelerate.optimizer import AcceleratedOptimizer

    return isinstance(optimizer, AcceleratedOptimizer)


# -- DeepSpeed: partitioned parameters ---------------------------------------------------------------------------------
def is_deepspeed_partitioned(param: torch.Tensor) -> bool:
    """Whether `param` is a parameter DeepSpeed ZeRO-3 has partitioned: ZeRO-3 gives each one an `ds_id` attribute
    (deepspeed.runtime.zero.partition_parameters; there is no public predicate). Checked: deepspeed 0.19.8."""
    return hasattr(param, "ds_id")


def deepspeed_needs_gather(param: torch.Tensor) -> bool:
    """Whether a ZeRO-3 partitioned `param` holds only its partition now. Inside a module's forward ZeRO-3 has gathered
    it (status AVAILABLE, active in that module), and a `GatheredParameters` around it would try to free it on exit,
    which ZeRO-3 refuses. `ds_status` is ZeRO-3's own bookkeeping (no public predicate). Checked: deepspeed 0.19.8."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]  # undeclared upstream attribute


def deepspeed_full_shape(param: torch.Tensor) -> torch.Size:
    """A ZeRO-3 partitioned parameter's whole shape (`ds_shape`; its `shape` is its partition's). Checked: deepspeed
    0.19.8."""
    return torch.Size(param.ds_shape)  # type: ignore[attr-defined]  # undeclared upstream attribute


def deepspeed_local_grad(param: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """This rank's part of `param`'s gradient as ZeRO holds it between backward and its optimizer step (reduced over
    ranks, not yet clipped), and where that part starts in the flattened parameter; None where this rank holds no
    part of it. No copy of the whole gradient is made.

    ZeRO-3: `deepspeed.utils.safe_get_local_grad` (public) is the flat fp32 partition of rank r, which starts at
    r * its size (`set_fp32_grad_for_param` slices a full value so). ZeRO-1/2 (and the bf16 optimizer): the fragment
    `param._hp_mapping` maps, read as `deepspeed.utils.tensor_fragment.get_full_hp_grad` reads it before it
    all-reduces a (V, d) buffer (no public API gives the local fragment). Checked: deepspeed 0.19.8
    (`runtime/zero/stage3.py`, `utils/tensor_fragment.py`)."""
    import torch.distributed as dist

    if is_deepspeed_partitioned(param):
        from deepspeed.utils import safe_get_local_grad

        local = safe_get_local_grad(param)
        if local is None:
            return None
        rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
        return local.reshape(-1), rank * local.numel()
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).reshape(-1)  # type: ignore[attr-defined]  # undeclared upstream attribute
    address = mapping.lp_fragment_address
    if fragment.numel() == param.numel():  # the whole parameter's gradient (as get_full_hp_grad narrows it)
        fragment = fragment.narrow(0, address.start, address.numel)
    return fragment, address.start


def is_deepspeed_mapped(param: torch.Tensor) -> bool:
    """Whether a ZeRO-1/2 (or bf16) optimizer maps `param` onto its flat fp32 partition: it sets `_hp_mapping` on each
    (`deepspeed.utils.safe_get_full_*` test the same attribute; no public predicate). Checked: deepspeed 0.19.8."""
    return hasattr(param, "_hp_mapping")


def in_deepspeed_engine(param: torch.Tensor) -> bool:
    """Whether a ZeRO-3 partitioned `param` belongs to a built engine's optimizer (`deepspeed.initialize` sets
    `_z3_optimizer` on each; `zero.Init` alone, as `from_pretrained` under a ZeRO-3 config, does not). Checked:
    deepspeed 0.19.8 (`runtime/zero/stage3.py`)."""
    return hasattr(param, "_z3_optimizer")


# -- torch: an embedding's gradient layout -----------------------------------------------------------------------------
@contextmanager
def sparse_embedding_gradient(module: nn.Module):
    """Within the block, an `nn.Embedding` returns a sparse weight gradient (its `sparse` flag, read by
    `F.embedding` at each forward; the module has no public way to ask for one call's gradient layout), so that a
    re-run of its forward builds only the looked-up rows. Restores the flag. Checked: torch 2.13.0."""
    if not isinstance(module, nn.Embedding):
        yield
        return
    sparse = module.sparse
    module.sparse = True
    try:
        yield
    finally:
        module.sparse = sparse


# -- torch: autograd engine --------------------------------------------------------------------------------------------
def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the current backward pass ends (`Variable._execution_engine.queue_callback`; DDP and
    FSDP2 finalise their gradients the same way, and there is no public equivalent). Must be called during
    backward. Checked: torch 2.13.0."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# -- torch: an LR scheduler's per-group lists --------------------------------------------------------------------------
# torch's schedulers keep one entry per param group in these lists (`base_lrs`, `_last_lr` on every LRScheduler;
# `lr_lambdas` on LambdaLR / MultiplicativeLR; `min_lrs` on ReduceLROnPlateau; `max_lrs`, `base_momentums`,
# `max_momentums` on CyclicLR) and zip them with `optimizer.param_groups` strictly (torch >= 2.13), so a group added
# after the scheduler was built needs its entries; SequentialLR and ChainedScheduler hold theirs in `_schedulers`, and
# accelerate's AcceleratedScheduler wraps the scheduler as `.scheduler`. Checked: torch 2.13.0, accelerate 1.13-1.15,
# transformers 5.12.1-5.24.0 (its schedulers are LambdaLR).
SCHEDULER_GROUP_LISTS = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


def has_lr_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a torch LR scheduler was built on `optimizer`: LRScheduler marks the `step` it wraps
    (`_wrapped_by_lr_sched`; torch 2.x)."""
    return bool(getattr(optimizer.step, "_wrapped_by_lr_sched", False))


def _scheduler_group_lists(scheduler: Any, seen: set[int] | None = None) -> Iterator[tuple[Any, str, list]]:
    """Each per-group list (`SCHEDULER_GROUP_LISTS`) of `scheduler`'s children (SequentialLR's and ChainedScheduler's
    `_schedulers`), then its own (accelerate's AcceleratedScheduler unwrapped), with the scheduler that holds it and
    its name: a list shared by several (SequentialLR's `_last_lr` is its first child's) once (`seen`: those done)."""
    seen = set() if seen is None else seen
    inner = getattr(scheduler, "scheduler", scheduler)
    for child in getattr(inner, "_schedulers", None) or ():
        yield from _scheduler_group_lists(child, seen)
    for name in SCHEDULER_GROUP_LISTS:
        values = getattr(inner, name, None)
        if isinstance(values, list) and id(values) not in seen:
            seen.add(id(values))
            yield inner, name, values


def extend_scheduler_groups(scheduler: Any, sources: list[int]) -> None:
    """Give `scheduler` (built before param groups were appended to its optimizer) an entry for each new group: a copy
    of the entry of its source group (`sources`, one index per appended group, in order). A per-group list of another
    length is refused by name."""
    for inner, name, values in list(_scheduler_group_lists(scheduler)):
        optimizer = getattr(inner, "optimizer", None)
        before = len(optimizer.param_groups) - len(sources) if optimizer is not None else None
        if before is not None and len(values) != before:
            raise UntieValueError(
                f"The LR scheduler {type(inner).__name__} keeps {len(values)} entries in {name}, for {before} param "
                "groups: it cannot be given the per-role groups. Build the scheduler after the run has split the "
                "groups (after untier.start(optimizer), or let Trainer build it), or leave the learning-rate scales "
                "at 1."
            )
        values.extend(values[source] for source in sources)


def drop_scheduler_groups(scheduler: Any, indices: list[int]) -> None:
    """Take the entries of the param groups at `indices` (removed from its optimizer again, before any step) out of
    `scheduler`'s per-group lists: the inverse of `extend_scheduler_groups`."""
    for _, _, values in list(_scheduler_group_lists(scheduler)):
        values[:] = [value for i, value in enumerate(values) if i not in indices]


# -- bitsandbytes: state buffers and per-parameter overrides -----------------------------------------------------------
# bitsandbytes' optimizers (subclasses of `bitsandbytes.optim.optimizer.Optimizer8bit`) allocate state through
# `get_state_buffer(p, dtype)` (paged memory for the paged optimizers on CUDA) and read per-parameter overrides
# (`optim_bits`, ...) from the process-wide `GlobalOptimManager`: `pid2config` keyed by id(param), `index2config`
# keyed by (group index, param index), and `module_weight_config_triple` from `register_module_override` (Trainer
# registers {"optim_bits": 32} for every nn.Embedding when it builds an 8-bit bitsandbytes optimizer). No public API
# gives a new parameter another's override or re-indexes the overrides after the groups are reordered.
# Checked: bitsandbytes 0.50.2 (CI).
def is_bitsandbytes_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is one of bitsandbytes' (they keep per-parameter overrides and allocate their own state)."""
    return type(optimizer).__module__.startswith("bitsandbytes.") and hasattr(optimizer, "mng")


def state_buffer_copy(optimizer: torch.optim.Optimizer, param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """A copy of `value`, one of a parameter's state tensors, for `param`: allocated the way `optimizer` allocates
    `param`'s state when it is shaped like it (bitsandbytes' paged buffers stay paged), else a plain clone."""
    if is_bitsandbytes_optimizer(optimizer) and value.shape == param.shape:
        return optimizer.get_state_buffer(param, dtype=value.dtype).copy_(value)  # type: ignore[attr-defined]  # undeclared upstream attribute
    return value.clone()


def bitsandbytes_override(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict | None:
    """The per-parameter config bitsandbytes applies to `param` (by parameter, else by module), None if none."""
    manager = optimizer.mng  # type: ignore[attr-defined]  # undeclared upstream attribute
    config = manager.pid2config.get(id(param))
    if config is None:
        for module, attr, module_config in getattr(manager, "module_weight_config_triple", ()):
            if getattr(module, attr, None) is param:
                config = module_config
    return config


def share_bitsandbytes_override(optimizer: torch.optim.Optimizer, *, new: nn.Parameter, like: nn.Parameter) -> None:
    """Give `new` its own copy of `like`'s bitsandbytes override (e.g. the 32-bit state Trainer asks for embeddings),
    so a head forked from a shared matrix is optimised with the same precision; nothing for other optimizers."""
    if not is_bitsandbytes_optimizer(optimizer):
        return
    config = bitsandbytes_override(optimizer, like)
    if config is not None:
        optimizer.mng.pid2config[id(new)] = dict(config)  # type: ignore[attr-defined]  # undeclared upstream attribute


def reindex_bitsandbytes_overrides(optimizer: torch.optim.Optimizer) -> None:
    """Rebuild bitsandbytes' position-keyed overrides from its parameter-keyed ones after the groups' order changed
    (a stale position entry would give a moved parameter another's config); nothing for other optimizers."""
    if not is_bitsandbytes_optimizer(optimizer):
        return
    manager = optimizer.mng  # type: ignore[attr-defined]  # undeclared upstream attribute
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            config = manager.pid2config.get(id(param))
            if config is None:
                manager.index2config.pop((group_index, param_index), None)
            else:
                manager.index2config[(group_index, param_index)] = config
    groups = optimizer.param_groups
    for group_index, param_index in list(manager.index2config):  # a position no parameter holds any more
        if group_index >= len(groups) or param_index >= len(groups[group_index]["params"]):
            del manager.index2config[(group_index, param_index)]


# -- peft: the modules PEFT inserts ------------------------------------------------------------------------------------
# `peft.utils.ModulesToSaveWrapper` (the trainable copy of a module named in `modules_to_save`), its base
# `peft.utils.AuxiliaryTrainingWrapper` (trainable tokens too) and `peft.tuners.tuners_utils.BaseTunerLayer` (every
# adapter layer): peft exports none at its top level and has no public "did PEFT insert this" query. Checked: peft
# 0.18.0, 0.19.0, 0.20.0 and 0.21.2.
def is_modules_to_save_copy(module: Any) -> bool:
    """Whether `module` is PEFT's `modules_to_save` wrapper (a trainable copy of the module it wraps)."""
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # no peft: PEFT wrapped nothing
        return False
    return isinstance(module, ModulesToSaveWrapper)


def has_peft_layers(model: nn.Module) -> bool:
    """Whether any module of `model` is an adapter layer or a trainable wrapper PEFT inserted (none remain after
    `merge_and_unload()`)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import AuxiliaryTrainingWrapper
    except ImportError:
        return False
    return any(isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)) for module in model.modules())
