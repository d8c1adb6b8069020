"""Model and optimizer surgery: tie and untie the input embedding and the LM head of a Hugging Face model.

Everything here is pure tensor/module bookkeeping with no Trainer dependency, so it can be used to convert
checkpoints, to prepare a model for fine-tuning, or from a training callback.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from untie import _compat
from untie.decision.settings import OPTIMIZER_STATES, TIE_INITS, OptimizerStateInit, TieInit
from untie.distributed import full_shape, gathered, is_split
from untie.errors import UntieRuntimeError, UntieTypeError, UntieValueError
from untie.roles import embedding_modules, input_weight, output_weight
from untie.structure.peft_support import refuse_peft_surgery

#: Config attribute written on untie, so a reloaded checkpoint can be recognised as deliberately untied even
#: where the `tie_word_embeddings` flag cannot record it (T5 and BART share that flag with encoder/decoder ties).
UNTIED_MARKER = "untied_output_embeddings"

StateInit = OptimizerStateInit


@dataclass(frozen=True)
class EmbeddingLayout:
    """Where the input embedding, the LM head and any output bias live inside a model (parameter names)."""

    input_weight: str
    output_weight: str
    output_bias: str | None
    bias_aliases: tuple[str, ...]
    """Other names registered for the output bias while tied (BERT's `cls.predictions.bias`): unused in forward."""


# ---------------------------------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------------------------------


def _names_of(model: nn.Module, param: nn.Parameter) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is param]


def embedding_layout(model: nn.Module) -> EmbeddingLayout:
    """Find the parameter names of the input embedding, the LM head weight and its bias (if any)."""
    input_emb, output_emb = embedding_modules(model)
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out_prefix = module_names[id(output_emb)]
    in_prefix = module_names[id(input_emb)]
    output_weight = f"{out_prefix}.weight" if out_prefix else "weight"
    input_weight = f"{in_prefix}.weight" if in_prefix else "weight"
    bias = getattr(output_emb, "bias", None)
    output_bias = aliases = None
    if isinstance(bias, nn.Parameter):
        output_bias = f"{out_prefix}.bias" if out_prefix else "bias"
        aliases = tuple(n for n in _names_of(model, bias) if n != output_bias)
        # An alias registered only while tied (BERT's `cls.predictions.bias`) is still a declared bias source after
        # the untie; find it through the tied-weights mapping so that the layout is the same before and after.
        params = dict(model.named_parameters(remove_duplicate=False))
        for target, source in _declared_ties(model).items():
            if target == output_bias and source in params and source not in aliases:
                aliases = (*aliases, source)
    return EmbeddingLayout(input_weight, output_weight, output_bias, tuple(aliases or ()))


def _declared_ties(model: nn.Module) -> dict[str, str]:
    """The class-level tied-weights mapping of `model` and its PreTrainedModel submodules, with full names."""
    mapping: dict[str, str] = {}
    for prefix, module in model.named_modules():
        keys = _compat.class_tied_keys(module)  # the class's mapping, not an instance override
        if keys is None:
            continue
        dot = f"{prefix}." if prefix else ""
        mapping.update({f"{dot}{target}": f"{dot}{source}" for target, source in keys.items()})
    return mapping


def _set(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name) if module_name else model, attr, value)


def is_tied(model: nn.Module) -> bool:
    """True when the LM head's weight *is* the input embedding's parameter (shared storage, not equal values)."""
    input_emb, output_emb = embedding_modules(model)
    return output_emb.weight is input_emb.weight


def _check_shapes(model: nn.Module, layout: EmbeddingLayout) -> None:
    w_in, w_out = model.get_parameter(layout.input_weight), model.get_parameter(layout.output_weight)
    shape_in, shape_out = full_shape(w_in), full_shape(w_out)
    if shape_in != shape_out:
        raise UntieValueError(
            f"{type(model).__name__}: input embedding {layout.input_weight} has shape {tuple(shape_in)} but the "
            f"LM head {layout.output_weight} has shape {tuple(shape_out)}; they cannot share one matrix. "
            "Resize one of them (model.resize_token_embeddings) or keep this model untied."
        )


def _refuse_sharded(model: nn.Module) -> None:
    """Refuse a model an engine has sharded (FSDP2, or any DeepSpeed ZeRO stage: a parameter added after
    `deepspeed.initialize` is never trained). A model ZeRO-3 partitioned at construction (`zero.Init`, as
    `from_pretrained` does under a ZeRO-3 config) but not yet in an engine is not refused: its matrices are gathered
    to copy them, and `deepspeed.initialize` partitions the new head with the rest."""
    for name, param in model.named_parameters():
        if (
            type(param).__name__ == "DTensor"
            or type(param.data).__name__ == "DTensor"
            or _compat.in_deepspeed_engine(param)
            or _compat.is_deepspeed_mapped(param)
        ):
            raise UntieRuntimeError(
                f"{name} is sharded (FSDP2 DTensor or DeepSpeed ZeRO). untie cannot change the embedding structure "
                "of a sharded model: a live untie under FSDP2 is silently reverted and DeepSpeed cannot take new "
                "parameters. Do it before sharding: create untie.Untier (or the Trainer with UntieCallback) before "
                "accelerator.prepare / fully_shard / deepspeed.initialize, or call untie_embeddings on the plain "
                "model and then prepare it; or train with DDP."
            )


# ---------------------------------------------------------------------------------------------------------------
# Tied-weights bookkeeping (config flag, instance mapping, marker)
# ---------------------------------------------------------------------------------------------------------------


def _configs(model: nn.Module) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    if hasattr(config, "get_text_config"):
        text = config.get_text_config(decoder=True)
        if text is not None and text is not config:
            configs.append(text)
    return configs


def _own_config(model: nn.Module) -> None:
    """Give `model` a config of its own before the tie flags are written: the config object it was built from may be
    shared (a second model built from it, a `model_init` that closes over it for Trainer's hyperparameter search), and
    a flag written there would build the next model untied, silently. Every module of the model that held the old
    config, or one of its sub-configs (a multimodal model's text_config), is pointed at the copy."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    owned = copy.deepcopy(config)
    replaced = {id(config): owned}
    for name, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(getattr(owned, name, None), "to_dict"):
            replaced[id(value)] = getattr(owned, name)  # text_config, vision_config, ...
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in replaced:
            module.__dict__["config"] = replaced[id(held)]


def _drop_head_ties(model: nn.Module, layout: EmbeddingLayout) -> None:
    """Remove the LM-head entries (weight and bias) from every module's tied-weights mapping, on the instance."""
    head_names = {layout.output_weight, layout.output_bias} - {None}
    for prefix, module in model.named_modules():
        keys = _compat.tied_keys(module)
        if not keys:
            continue
        dot = f"{prefix}." if prefix else ""
        kept = {t: s for t, s in keys.items() if f"{dot}{t}" not in head_names}
        if len(kept) != len(keys):
            _compat.set_instance_tied_keys(module, kept)


def _restore_head_ties(model: nn.Module) -> None:
    """Undo `_drop_head_ties`: fall back to the class-level tied-weights mapping."""
    for module in model.modules():
        _compat.clear_instance_tied_keys(module)


def _mark_untied(model: nn.Module, layout: EmbeddingLayout) -> None:
    _own_config(model)
    _drop_head_ties(model, layout)
    remaining_ties = _remaining_ties(model)
    keeps_other_ties = False
    for config in _configs(model):
        # The flag is all-or-nothing: where it also ties the encoder and decoder embeddings to `shared` (BART,
        # mBART, Marian) clearing it would let plain transformers load those three apart. It is cleared anyway, so that
        # no tie_weights() / resize_token_embeddings() of plain transformers can re-tie the trained head: the three
        # stay one parameter in memory (nothing here unshares them), are saved as equal copies (the state-dict hook
        # below) and are shared again by `untie_embeddings` after a reload. T5's config forces the flag back to True
        # on load (turning a False into `scale_decoder_outputs=False`), so there it stays True; the instance mapping
        # plus the load-time "both present and different" rule keep the head free (see README, Limits).
        if hasattr(config, "tie_word_embeddings") and (not remaining_ties or _flag_survives_reload(config)):
            config.tie_word_embeddings = False
            keeps_other_ties = keeps_other_ties or remaining_ties
        setattr(config, UNTIED_MARKER, True)
    if keeps_other_ties:
        _store_other_ties_apart(model)
    _compat.refresh_tied_keys_cache(model)


def _flag_survives_reload(config) -> bool:
    """Whether `tie_word_embeddings=False` is read back as False (T5's config forces it to True)."""
    data = config.to_dict()
    data["tie_word_embeddings"] = False
    return type(config).from_dict(data).tie_word_embeddings is False


def other_ties(model: nn.Module) -> dict[str, str]:
    """Declared ties other than the LM head's (BART's encoder/decoder embeddings -> shared), full names."""
    layout = embedding_layout(model)
    head = {layout.output_weight, layout.output_bias}
    params = dict(model.named_parameters(remove_duplicate=False))
    return {t: s for t, s in _declared_ties(model).items() if t not in head and t in params and s in params}


_STORE_APART_ATTR = "_untie_store_apart_handle"


def _store_other_ties_apart(model: nn.Module) -> None:
    """Save the declared non-head ties as separate equal tensors, so a config without the tie flag loads them all."""
    if getattr(model, _STORE_APART_ATTR, None) is None:
        setattr(model, _STORE_APART_ATTR, model.register_state_dict_post_hook(_clone_other_ties))


def _clone_other_ties(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for target, source in other_ties(module).items():
        key, source_key = prefix + target, prefix + source
        if key in state_dict and source_key in state_dict and _same_storage(state_dict[key], state_dict[source_key]):
            state_dict[key] = state_dict[key].clone()


def _same_storage(first, second) -> bool:
    if not (torch.is_tensor(first) and torch.is_tensor(second)) or first.is_meta or second.is_meta:
        return first is second
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def _reshare_other_ties(model: nn.Module) -> None:
    """Share again the non-head ties a reload left apart (BART saved with `tie_word_embeddings=False`), where equal."""
    for target, source in other_ties(model).items():
        kept, loaded = model.get_parameter(source), model.get_parameter(target)
        if loaded is kept:
            continue
        if loaded.shape == kept.shape and torch.equal(loaded.detach(), kept.detach()):
            _set(model, target, kept)
        else:
            _compat.warn_in_user_code(
                f"untie: {target} differs from {source}, which its architecture ties it to (trained apart with "
                "plain transformers?); both are kept as they are."
            )


def _remaining_ties(model: nn.Module) -> bool:
    return any(_compat.tied_keys(module) for module in model.modules())


def _mark_tied(model: nn.Module) -> None:
    handle = getattr(model, _STORE_APART_ATTR, None)
    if handle is not None:
        handle.remove()
        setattr(model, _STORE_APART_ATTR, None)
    _restore_head_ties(model)
    _own_config(model)
    for config in _configs(model):
        if hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = True
        if hasattr(config, UNTIED_MARKER):
            delattr(config, UNTIED_MARKER)
    _compat.refresh_tied_keys_cache(model)


def was_untied(model: nn.Module) -> bool:
    """True when the model's config records a deliberate untie (by this library), e.g. after a reload."""
    return any(getattr(c, UNTIED_MARKER, False) for c in _configs(model))


def untie_recorded(model: nn.Module) -> bool:
    """True when the config says the head is untied: this library's marker, or `tie_word_embeddings=False`."""
    return was_untied(model) or any(getattr(c, "tie_word_embeddings", None) is False for c in _configs(model))


# ---------------------------------------------------------------------------------------------------------------
# Public surgery
# ---------------------------------------------------------------------------------------------------------------


def untie_embeddings(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    optimizer_state: StateInit = "copy",
) -> nn.Module:
    """Give the LM head its own parameter, an exact copy of the shared matrix, and update the model's bookkeeping.

    With `optimizer`, the new head joins the param group of the shared matrix (so LR schedulers keep working) and
    its optimizer state starts as a copy of the shared matrix's state (`optimizer_state="copy"`, a smooth fork)
    or empty (`"reset"`, the head re-warms its moments like a fresh parameter); `"fresh"` empties the embedding's
    state too, so that both matrices re-warm their moments from their own role's gradients (the shared matrix's
    second moments are mostly the output role's, larger than the input role's gradients alone, and kept by the
    embedding they shrink its steps for hundreds of steps after the untie).

    On a model that is already untied this only re-applies the bookkeeping (idempotent, with a warning), which is
    what a reloaded T5/BART checkpoint needs before `tie_weights()` / `resize_token_embeddings()`.
    """
    if optimizer_state not in OPTIMIZER_STATES:
        raise UntieValueError(f"optimizer_state={optimizer_state!r} is not one of {OPTIMIZER_STATES}.")
    refuse_peft_surgery(model, "untie")
    _refuse_packed_weights(model, "untie")
    layout = embedding_layout(model)
    if not is_tied(model):
        if not was_untied(model):
            _compat.warn_in_user_code(
                f"{type(model).__name__} is already untied; untie_embeddings() only updated its config so that it "
                "saves, reloads and resizes untied. Nothing was copied."
            )
        _freeze_bias_aliases(model, layout)
        _reshare_other_ties(model)
        _mark_untied(model, layout)
        return model
    _refuse_sharded(model)
    shared = model.get_parameter(layout.input_weight)
    with gathered(shared):
        _check_shapes(model, layout)
        head = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
    _set(model, layout.output_weight, head)
    # The bias used in forward keeps its identity (and its optimizer state and DDP registration); any other name it
    # was registered under while tied gets its own frozen copy, so both keys save and reload without a dropped bias.
    if layout.output_bias is not None:
        bias = model.get_parameter(layout.output_bias)
        for alias in layout.bias_aliases:
            if model.get_parameter(alias) is bias:
                _set(model, alias, nn.Parameter(bias.detach().clone(), requires_grad=False))
    _mark_untied(model, layout)
    if head is shared or (not shared.is_meta and head.data_ptr() == shared.data_ptr()):
        raise UntieRuntimeError(f"untie: the new LM head still shares storage with {layout.input_weight} (a bug).")
    if optimizer is not None:
        add_param_like(optimizer, new=head, like=shared, state=optimizer_state)
        sort_param_groups(optimizer, model)
    return model


def _refuse_packed_weights(model: nn.Module, action: str) -> None:
    """Refuse an embedding or head whose weight is not a tensor: a dynamically quantized module
    (`torch.ao.quantization.quantize_dynamic`) packs it as int8 behind a `weight()` method, which no one can tie,
    untie or train (is_tied() would call such a model untied, and surgery would return without a word)."""
    embedding, head = embedding_modules(model)
    roles = (("LM head", head), ("input embedding", embedding))
    for role, module in roles:
        if module is not None and not isinstance(getattr(module, "weight", None), torch.Tensor):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            raise UntieTypeError(
                f"{action}_embeddings: the {role} is a {kind}, whose weight is not a tensor but packed (a dynamically "
                f"quantized module, torch.ao.quantization.quantize_dynamic): it cannot be {action}d or trained. "
                f"{action.capitalize()} the floating-point model first, then quantize it."
            )


def _freeze_bias_aliases(model: nn.Module, layout: EmbeddingLayout) -> None:
    """After a reload, bias aliases are trainable again; freeze them so optimizers are built as before the save."""
    for alias in layout.bias_aliases:
        model.get_parameter(alias).requires_grad_(False)


def tie_embeddings(model: nn.Module, init: TieInit = "input") -> nn.Module:
    """Tie an untied model: the shared matrix becomes the input embedding, initialised from `init`.

    `init="input"` keeps the input embedding, `"output"` keeps the LM head, `"mean"` averages them. Any output bias
    keeps its trained values. The config is updated so the model saves and reloads tied. Call this before the
    optimizer is built: the dropped head's parameter would otherwise stay in the optimizer.
    """
    if init not in TIE_INITS:
        raise UntieValueError(
            f"init={init!r} is not one of {TIE_INITS}: choose which matrix the tied weight starts from."
        )
    refuse_peft_surgery(model, "tie")
    _refuse_packed_weights(model, "tie")
    layout = embedding_layout(model)
    if is_tied(model):
        _compat.warn_in_user_code(f"{type(model).__name__} is already tied; tie_embeddings() did nothing.")
        return model
    _refuse_sharded(model)
    _check_shapes(model, layout)
    w_in, w_out = model.get_parameter(layout.input_weight), model.get_parameter(layout.output_weight)
    with torch.no_grad():
        if init == "output":
            w_in.copy_(w_out)
        elif init == "mean":
            w_in.copy_((w_in.float() + w_out.float()).div_(2).to(w_in.dtype))
    # The head's trained bias must survive the re-tie: tie_weights() copies the alias (source) into the head.
    if layout.output_bias is not None:
        bias = model.get_parameter(layout.output_bias)
        for alias in layout.bias_aliases:
            alias_param = model.get_parameter(alias)
            with torch.no_grad():
                alias_param.copy_(bias)
            alias_param.requires_grad_(bias.requires_grad)
    _mark_tied(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # type: ignore[operator]  # a PreTrainedModel's method
    if not is_tied(model):  # models without a declared mapping: tie by hand
        _set(model, layout.output_weight, w_in)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Optimizer surgery
# ---------------------------------------------------------------------------------------------------------------


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer behind accelerate's AcceleratedOptimizer (which proxies the same groups and state)."""
    return getattr(optimizer, "optimizer", optimizer)


def add_param_like(
    optimizer: torch.optim.Optimizer, *, new: nn.Parameter, like: nn.Parameter, state: StateInit = "copy"
) -> None:
    """Put `new` in the param group that holds `like`, with a copy of `like`'s optimizer state or none.

    Appending to an existing group (instead of `add_param_group`) keeps LR schedulers valid: torch >= 2.13
    schedulers raise on a group they did not see at construction.
    """
    opt = inner_optimizer(optimizer)
    group = next((g for g in opt.param_groups if any(p is like for p in g["params"])), None)
    if group is None and not (like.requires_grad or new.requires_grad):
        return  # a frozen matrix is in no optimizer (Trainer leaves it out), and its frozen copy joins none either
    if group is None:
        raise UntieValueError(
            "The shared embedding parameter is not in the optimizer, so the untied head would not train. Build the "
            "optimizer from model.parameters() (Trainer does), or untie before creating it."
        )
    if any(p is new for g in opt.param_groups for p in g["params"]):
        return
    group["params"].append(new)
    start_state_like(optimizer, new=new, like=like, state=state)


def drop_param(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> None:
    """Take `param` out of `optimizer` (its param group and its state): a head dropped by a tie before the first
    step. The inverse of `add_param_like`; the parameters after it move up, so bitsandbytes' position-keyed overrides
    are rebuilt as `sort_param_groups` does."""
    inner = inner_optimizer(optimizer)
    for group in inner.param_groups:
        group["params"] = [p for p in group["params"] if p is not param]
    inner.state.pop(param, None)
    _compat.reindex_bitsandbytes_overrides(inner)


def start_state_like(
    optimizer: torch.optim.Optimizer, *, new: nn.Parameter, like: nn.Parameter, state: StateInit = "copy"
) -> None:
    """Start `new`, a parameter forked from `like` and already in the optimizer, as `like` is optimised: with
    `like`'s per-parameter optimizer settings (bitsandbytes' precision override) and, for ``"copy"``, its state;
    ``"fresh"`` also empties `like`'s state (the optimizer starts it anew at its next step, as for a new parameter)."""
    _compat.share_bitsandbytes_override(inner_optimizer(optimizer), new=new, like=like)
    if state == "copy":
        copy_optimizer_state(optimizer, new=new, like=like)
    elif state == "fresh":
        inner_optimizer(optimizer).state.pop(like, None)


def copy_optimizer_state(optimizer: torch.optim.Optimizer, *, new: nn.Parameter, like: nn.Parameter) -> None:
    """Give `new` an exact copy of `like`'s optimizer state; nothing if `like` has none yet.

    Every entry is copied, whatever it holds: Adam's moments, Adafactor's factored row and column moments, the step,
    and an 8-bit optimizer's quantised moments (bitsandbytes: uint8 codes, per-block scales, quantisation maps).
    `new` has `like`'s shape, dtype and device, so the state is valid for it as it is, block layout included. State
    tensors shaped like the parameter are allocated as the optimizer allocates them (paged buffers stay paged).
    """
    opt = inner_optimizer(optimizer)
    old_state = opt.state.get(like)
    if not old_state:
        return
    opt.state[new] = {
        key: _compat.state_buffer_copy(opt, new, value) if torch.is_tensor(value) else copy.deepcopy(value)
        for key, value in old_state.items()
    }


def sort_param_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Order each group's params as `model.named_parameters()` does, like a freshly built optimizer.

    `Optimizer.load_state_dict` matches parameters by position, so a resumed run (whose optimizer Trainer builds
    from the untied model) only restores the right moments if the live-untied optimizer saved them in that order.
    State is keyed by parameter, so reordering changes nothing else.
    """
    rank = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    opt = inner_optimizer(optimizer)
    for group in opt.param_groups:
        group["params"].sort(key=lambda p: rank.get(id(p), len(rank)))
    _compat.reindex_bitsandbytes_overrides(opt)


def draw_head(model: nn.Module, owner: str) -> None:
    """Draw `model`'s LM head (untied, before the first step) with the model's own initialiser, as a model built
    untied has it (`UntieConfig.head_init="model"`); the output module's bias, if any, is kept. A head that is sharded
    or partitioned already keeps its copy of the embedding, and a warning naming `owner` says so."""
    head = output_weight(model)
    if is_split(head):
        _compat.warn_in_user_code(
            f"{owner}: head_init='model' draws the head before the model is sharded; this one is sharded already, so "
            "the head starts as a copy of the embedding. Build the model unsharded (no zero.Init), or pass "
            "head_init='copy' to silence this."
        )
        return
    module = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(module, nn.Module) or getattr(module, "weight", None) is not head:
        raise UntieRuntimeError(f"{owner}: head_init='model' found no output module holding the head to draw.")
    bias = getattr(module, "bias", None)
    kept = bias.detach().clone() if isinstance(bias, torch.Tensor) else None
    _compat.init_module_weights(model, module)
    if kept is not None and bias is not None:  # the draw is of the weight: a bias (trained, or zeros) stays as it was
        with torch.no_grad():
            bias.copy_(kept)
    embedding = input_weight(model)
    if torch.equal(head, embedding):  # an initialiser that leaves this module to its parent (T5, transformers 5.12)
        with torch.no_grad():
            head.normal_(0.0, float(embedding.std()))  # drawn at the embedding's scale, as the tied init had it
