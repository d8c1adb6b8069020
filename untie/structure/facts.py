"""What a run reads off its model for its decision (`untie.decision.decide.decide`): the one fact reader. `read_facts`
at attach (the one read of the weights: the policy's freshness evidence, a collective in a distributed run; the
tokenizer's pairs, `pairs_for`), `model_facts` again when a plan changed the model's structure (cheap)."""

from __future__ import annotations

import logging

from torch import nn

from untie import _compat
from untie.decision.decide import Facts
from untie.decision.plan import ModelFacts, Structure
from untie.decision.settings import UntieConfig
from untie.distributed import full_shape, is_sharded, is_split, world_size
from untie.errors import UntieValueError
from untie.signals.pairs import is_tokenizer, tokenizer_pairs
from untie.structure.peft_support import is_peft_model, split_by_modules_to_save
from untie.structure.policy import read_for_policy
from untie.structure.surgery import input_weight, is_tied, output_weight, untie_recorded, was_untied

logger = logging.getLogger(__name__)


def structure_of(model: nn.Module, emulating: bool = False) -> Structure:
    """The model's structure (`untie.decision.plan`): "emulated" while a run keeps its separate head equal
    (`emulating`)."""
    if emulating:
        return "emulated"
    return "tied" if is_tied(model) else "untied"


def model_facts(model: nn.Module, *, emulating: bool = False, optimizer_built: bool = False) -> ModelFacts:
    """What `untie.decision.plan.plan_structure` needs to know about `model` now."""
    peft = is_peft_model(model)
    structure = structure_of(model, emulating)
    recorded = peft and untie_recorded(model)
    return ModelFacts(
        structure=structure,
        marked_untied=was_untied(model),
        peft=peft,
        config_says_untied=recorded,
        peft_split=tuple(split_by_modules_to_save(model)) if peft and structure != "tied" and not recorded else (),
        optimizer_built=optimizer_built,
        distributed=world_size() > 1,
        sharded=not peft and structure == "tied" and is_sharded(input_weight(model)),
    )


def read_facts(
    model: nn.Module,
    config: UntieConfig,
    *,
    engine: str | None,
    optimizer_built: bool = False,
    tokenizer=None,
    listed: list[tuple[int, int]] | None = None,
    owner: str = "UntieRun",
    hint: str = "tokenizer=tokenizer",
) -> tuple[Facts, list[tuple[int, int]]]:
    """Everything the decision needs to know about `model` at attach, read once (every rank calls it: the
    freshness evidence takes rank 0's verdict), and the pairs the run measures (`pairs_for`: the tokenizer's, or the
    `listed` ones). `engine`: the training engine (`untie.distributed.training_engine`); `owner` and `hint`: the
    adapter's name and how it takes a tokenizer, for the messages."""
    facts = model_facts(model, optimizer_built=optimizer_built)
    if not facts.peft:
        refuse_float8(model)
    pairs, because = pairs_for(config, tokenizer, model, list(listed or []), owner=owner, hint=hint)
    tied = is_tied(model) and not was_untied(model)
    policy, _ = config.chosen_policy()
    reading = read_for_policy(policy, model, tied=tied, peft=facts.peft, from_scratch=config.from_scratch)
    # FSDP2 and DeepSpeed shard a head drawn before sharding: the first forward cannot replace it in place.
    replaceable = engine is None and not facts.peft and not is_split(output_weight(model))
    blocked = "DeepSpeed's engine owns the optimizer's param groups" if engine == "DEEPSPEED" else None
    if not facts.peft and not input_weight(model).requires_grad:
        blocked = "the input embedding is frozen"
    arrived_untied = not is_tied(model) and (not facts.peft or facts.config_says_untied)
    read = Facts(
        facts,
        tied,
        reading,
        pairs=bool(pairs),
        no_pairs_because=because,
        head_replaceable=replaceable,
        scale_blocked_by=blocked,
        arrived_untied=arrived_untied,
        engine=engine,
    )
    return read, pairs


def refuse_float8(model: nn.Module) -> None:
    """Refuse an input embedding or LM head stored in a float8 dtype (one byte per value), before anything reads or
    changes it: torch's initialisers (a drawn head), its optimizers and the run's measurements do not run on it."""
    for role, weight in (("input embedding", input_weight(model)), ("LM head", output_weight(model))):
        if weight.dtype.is_floating_point and weight.dtype.itemsize == 1:
            raise UntieValueError(
                f"untie: the model's {role} is stored as {weight.dtype} (float8), which torch cannot initialise or "
                "train in place: a head drawn, copied or trained apart from it would break inside torch. Keep the "
                "embedding and the head in bfloat16 or float32 (float8 training, as torchao's, keeps high-precision "
                "weights and casts only the matmuls), e.g. model.get_input_embeddings().to(torch.bfloat16)."
            )


def read_pairs(
    tokenizer, model: nn.Module | None, *, asked: bool, owner: str, hint: str
) -> tuple[list[tuple[int, int]], str | None]:
    """The tokenizer's most frequent case and word-start variants that the model has rows for, and why there are
    none (None where there are some, or where the user asked and was warned).

    `asked`: the user chose pairs="auto" (a missing tokenizer is an error, an empty result a warning); else pairs=None
    found a tokenizer (an empty result is only said by the rule's message). `hint`: how the adapter takes a tokenizer.
    """
    if tokenizer is None:
        raise UntieValueError(
            f"{owner}(pairs='auto') reads the pairs from the tokenizer: pass it ({hint}), or list the pairs yourself: "
            "pairs=[(id_a, id_b), ...]."
        )
    rows = full_shape(input_weight(model))[0] if model is not None else None
    pairs = tokenizer_pairs(tokenizer, max_id=rows)
    within = f" among the model's {rows} embedding rows" if rows is not None else ""
    because = None
    if pairs:
        shown = ", ".join("/".join(p.tokens) for p in pairs[:6])
        logger.info("untie: pairs='auto' measures %d pairs from the tokenizer (%s, ...)", len(pairs), shown)
    elif asked:
        _compat.warn_in_user_code(
            f"{owner}(pairs='auto'): the tokenizer's vocabulary has no case or word-start variants{within}, so no "
            "pair is measured. Pass pairs=[(id_a, id_b), ...]."
        )
    else:
        because = f"the tokenizer's vocabulary has no case or word-start variants{within}"
    return [p.ids for p in pairs], because


def pairs_for(
    config: UntieConfig, tokenizer, model: nn.Module, listed: list[tuple[int, int]], *, owner: str, hint: str
) -> tuple[list[tuple[int, int]], str | None]:
    """The pairs a run measures and why there are none: the tokenizer's (`read_pairs`) where `config.pairs` is "auto",
    or None with a tokenizer given; else the `listed` ones, refused where an id lies outside the vocabulary. `owner`
    and `hint`: the adapter's name and how it takes a tokenizer, for the messages."""
    if config.pairs == "auto" or (config.pairs is None and is_tokenizer(tokenizer)):
        return read_pairs(tokenizer, model, asked=config.pairs == "auto", owner=owner, hint=hint)
    pairs = listed
    rows = full_shape(input_weight(model))[0] if pairs else 0
    outside = sorted({token for pair in pairs for token in pair if token >= rows})
    if outside:  # refused now, not at the first measurement (an IndexError at step `metrics_every`)
        raise UntieValueError(
            f"{owner}: pairs={pairs} holds token id(s) {outside} outside the model's vocabulary ({rows} rows "
            f"of its input embedding): pass pairs of ids in [0, {rows}) from this model's tokenizer, or pairs='auto' "
            f"with the tokenizer ({hint})."
        )
    return pairs, None
