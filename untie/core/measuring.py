"""What a run reads off the model besides the role gradients: the tokenizer's pairs that the model has rows for
(`read_pairs`), and the drift between the two spaces once untied (`drift`). Plain functions of the model; the run
(`untie.core.run.UntieRun`) keeps what they return."""

from __future__ import annotations

import logging

from torch import nn

from untie import _compat
from untie.distributed import full_shape, gather_rows, gathered, is_sharded
from untie.errors import UntieValueError
from untie.signals.metrics import drift_metrics, sampled_drift_metrics
from untie.signals.pairs import tokenizer_pairs
from untie.structure.surgery import input_weight, output_weight

logger = logging.getLogger(__name__)

#: Sample sizes of the drift metrics measured during training: about 0.1 s on CPU for GPT-2 small.
DRIFT_SAMPLE = {"queries": 256, "pool": 4096, "rows": 2048}


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


def drift(model: nn.Module, pairs: list[tuple[int, int]], step: int) -> dict[str, float]:
    """The drift metrics between the untied model's embedding and head (`untie.signals.metrics.drift_metrics`) on
    `DRIFT_SAMPLE`, seeded by `step`. Every rank must call it: ZeRO-3 gathers both matrices, FSDP2 reads only the
    sampled rows of each rank's shard (every rank samples the same rows)."""
    embedding = input_weight(model)
    head = output_weight(model)
    if not is_sharded(embedding):
        with gathered(embedding, head):
            return drift_metrics(embedding, head, pairs=pairs, seed=step, **DRIFT_SAMPLE)
    return sampled_drift_metrics(
        lambda ids: (gather_rows(embedding, ids), gather_rows(head, ids)),
        vocab=full_shape(embedding)[0],
        pairs=pairs,
        seed=step,
        **DRIFT_SAMPLE,
    )
