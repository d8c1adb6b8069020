"""What a run reads off its model for its decision (`untie.decision.decide.decide`): `read_facts` at attach (the
one read of the weights: the policy's freshness evidence, a collective in a distributed run), `model_facts` again
when a plan changed the model's structure (cheap)."""

from __future__ import annotations

from torch import nn

from untie.decision.decide import Facts
from untie.decision.plan import ModelFacts, Structure
from untie.decision.settings import UntieConfig
from untie.distributed import is_sharded, is_split, world_size
from untie.errors import UntieValueError
from untie.structure.peft_support import is_peft_model, split_by_modules_to_save
from untie.structure.policy import read_for_policy
from untie.structure.surgery import input_weight, is_tied, output_weight, untie_recorded, was_untied


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
    pairs: bool = False,
    no_pairs_because: str | None = None,
) -> Facts:
    """Everything the decision needs to know about `model` at attach, read once (every rank calls it: the
    freshness evidence takes rank 0's verdict). `engine`: the training engine (`untie.distributed.training_engine`);
    `pairs`: the run measures pairs (`no_pairs_because`: why not)."""
    facts = model_facts(model, optimizer_built=optimizer_built)
    if not facts.peft:
        refuse_float8(model)
    tied = is_tied(model) and not was_untied(model)
    policy, _ = config.chosen_policy()
    reading = read_for_policy(policy, model, tied=tied, peft=facts.peft, from_scratch=config.from_scratch)
    # FSDP2 and DeepSpeed shard a head drawn before sharding: the first forward cannot replace it in place.
    replaceable = engine is None and not facts.peft and not is_split(output_weight(model))
    blocked = "DeepSpeed's engine owns the optimizer's param groups" if engine == "DEEPSPEED" else None
    if not facts.peft and not input_weight(model).requires_grad:
        blocked = "the input embedding is frozen"
    return Facts(facts, tied, reading, pairs, no_pairs_because, replaceable, scale_blocked_by=blocked)


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
