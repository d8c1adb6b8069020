"""Describe a checkpoint's embedding tying, and how far its untied input and output spaces have drifted apart.

`describe()` answers what `from_pretrained` would give (tied or untied, which parameters, config flags) from the
config and the two embedding tensors alone, falling back to a full load only when the tensors cannot be found by
name. For untied checkpoints it measures, on sampled tokens, whether the input and the output spaces agree: the
distributional hypothesis holds for a model whose two spaces have the same neighbourhoods.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch

from untie.checkpoints.loading import (
    Checkpoint,
    check_stored_shapes,
    open_checkpoint,
    read_tensor,
    stored_keys,
    stored_name,
)
from untie.errors import UntieTypeError, UntieValueError
from untie.signals.metrics import knn_overlap, knn_overlap_chance, linear_cka, pair_distances, pair_key
from untie.signals.pairs import tokenizer_pairs
from untie.structure.surgery import UNTIED_MARKER, embedding_layout, input_weight, is_tied, output_weight

#: Default sample sizes: about a second per measure on 2 CPU cores at 256k x 4096.
SAMPLE = {"queries": 512, "pool": 8192, "rows": 2048, "k": 10}


def describe(
    source: str | os.PathLike,
    *,
    head: str = "auto",
    pairs: Sequence[tuple[int | str, int | str]] | Literal["auto"] = (),
    revision: str | None = None,
    seed: int = 0,
    **sample: int,
) -> dict[str, Any]:
    """A JSON-ready report on checkpoint `source` (folder or hub id): tying, names, shapes, flags, drift if untied.

    `pairs` are token pairs (ids, or tokens the checkpoint's tokenizer maps to one id each) whose distances are
    reported in both spaces; "auto" reads them from the checkpoint's tokenizer (`untie.tokenizer_pairs`). `sample`
    overrides `SAMPLE` (queries, pool, rows, k).
    """
    unknown = set(sample) - set(SAMPLE)
    if unknown:
        raise UntieTypeError(f"describe() got unknown sample sizes {sorted(unknown)}; choose among {sorted(SAMPLE)}.")
    sample = {**SAMPLE, **sample}
    started = time.perf_counter()
    checkpoint = open_checkpoint(source, head=head, revision=revision)
    model = checkpoint.empty_model
    layout = embedding_layout(model)
    check_stored_shapes(checkpoint, {layout.input_weight, layout.output_weight})
    declared_tied = is_tied(model)
    tensors = _read_embeddings(checkpoint, model, layout, declared_tied)
    loaded = "embeddings only" if tensors is not None else "full model"
    if tensors is None:
        tensors = _load_embeddings(checkpoint)
    input_weight, output_weight, head_stored, bias_stored = tensors
    tied = output_weight is None
    config = checkpoint.config
    report: dict[str, Any] = {
        "source": os.fspath(source),
        "model_class": checkpoint.model_class.__name__,
        "model_type": config.model_type,
        "tied": tied,
        "status": "",
        "input_embedding": _entry(layout.input_weight, input_weight),
        "output_embedding": _entry(layout.output_weight, input_weight if tied else output_weight),
        "output_bias": None,
        "head_stored": head_stored,
        "config": {
            **config_levels(config),
            UNTIED_MARKER: bool(getattr(config, UNTIED_MARKER, False)),
            "vocab_size": _vocab_size(config),
        },
        "notes": [],
        "loaded": loaded,
        "policy": _policy(model, declared_tied, input_weight),
    }
    if layout.output_bias is not None:
        # Only names that really share the bias in the model from_pretrained builds: an untied checkpoint stores the
        # alias (BERT's cls.predictions.bias) as its own tensor, which the layout still lists as a declared source.
        bias = model.get_parameter(layout.output_bias)
        shared = [name for name in layout.bias_aliases if model.get_parameter(name) is bias]
        report["output_bias"] = {"name": layout.output_bias, "tied_to": shared or None}
        if not bias_stored:
            report["notes"].append(f"{layout.output_bias} is not stored: from_pretrained initialises it (zeros).")
    report["status"] = _status(report, declared_tied, head_stored)
    report["notes"][:0] = _notes(report) + _level_notes(report)
    if pairs == "auto":
        found = tokenizer_pairs(_tokenizer(checkpoint, "read the pairs"), max_id=input_weight.shape[0])
        pairs = [pair.tokens for pair in found]
        token_pairs = [pair.ids for pair in found]
        report["pairs_from"] = f"tokenizer: {len(found)} most frequent case and word-start variants (untie.pairs)"
    else:
        token_pairs = _token_ids(checkpoint, pairs)
    read = time.perf_counter()
    if token_pairs:  # keyed as the user wrote them ("king-queen", "464-262"); tied: both distances are the same
        inputs = pair_distances(input_weight, token_pairs)
        outputs = inputs if tied else pair_distances(output_weight, token_pairs)
        report["pairs"] = {}
        for given, ids in zip(pairs, token_pairs, strict=True):
            key, label = pair_key(ids), "-".join(map(str, given))
            report["pairs"][label] = {"ids": list(ids), "input": inputs[key], "output": outputs[key]}
    if not tied:
        report["drift"] = drift_report(input_weight, output_weight, seed=seed, **sample)
    report["seconds"] = {"read": round(read - started, 3), "drift": round(time.perf_counter() - read, 3)}
    return report


def drift_report(
    input_weight: torch.Tensor,
    output_weight: torch.Tensor,
    *,
    seed: int = 0,
    queries: int = SAMPLE["queries"],
    pool: int = SAMPLE["pool"],
    rows: int = SAMPLE["rows"],
    k: int = SAMPLE["k"],
) -> dict[str, Any]:
    """Neighbour overlap and linear CKA between the two untied spaces, each with its chance level.

    The chance levels make the numbers readable: `knn_overlap_chance` is the overlap of unrelated spaces, and the
    CKA of the input space against the output space with its rows shuffled is what CKA gives without token order.
    """
    vocab = input_weight.shape[0]
    k = min(k, max(1, min(pool, vocab) // 2))
    # The shuffled baseline pairs each sampled input row with another token's output row (no V x d copy).
    generator = torch.Generator().manual_seed(seed)
    count = min(rows, vocab)
    sample = torch.randperm(vocab, generator=generator)[:count]
    other = torch.randperm(vocab, generator=generator)[:count]
    report = {
        "knn_overlap": knn_overlap(input_weight, output_weight, k=k, queries=queries, pool=pool, seed=seed),
        "knn_overlap_chance": knn_overlap_chance(k, min(pool, vocab)),
        "cka": linear_cka(input_weight[sample], output_weight[sample], rows=None),
        "cka_shuffled": linear_cka(input_weight[sample], output_weight[other], rows=None),
        "sample": {"queries": min(queries, vocab), "pool": min(pool, vocab), "rows": count, "k": k},
    }
    return report


# ---------------------------------------------------------------------------------------------------------------
# Reading the embeddings
# ---------------------------------------------------------------------------------------------------------------


def _read_embeddings(checkpoint: Checkpoint, model, layout, declared_tied: bool):
    """(input, output or None if tied, head stored?, bias stored?) from the safetensors files; None if not found."""
    keys = stored_keys(checkpoint)
    if keys is None:
        return None
    input_key = stored_name(model, layout.input_weight, keys)
    if input_key is None:
        return None
    output_key = stored_name(model, layout.output_weight, keys)
    bias_stored = layout.output_bias is None or any(
        stored_name(model, name, keys) is not None for name in (layout.output_bias, *layout.bias_aliases)
    )
    input_weight = read_tensor(checkpoint, input_key, keys)
    if output_key is None:
        if not declared_tied:
            return None  # a renamed head key (or a truly missing one): let from_pretrained decide
        return input_weight, None, False, bias_stored
    output_weight = read_tensor(checkpoint, output_key, keys)
    # from_pretrained's rule: a declared tie holds when both tensors are stored only if they are equal.
    if declared_tied and output_weight.shape == input_weight.shape and torch.equal(output_weight, input_weight):
        return input_weight, None, True, bias_stored
    return input_weight, output_weight, True, bias_stored


def _load_embeddings(checkpoint: Checkpoint):
    loaded: Any = checkpoint.model_class.from_pretrained(  # (model, info) with output_loading_info=True
        checkpoint.source, revision=checkpoint.revision or "main", dtype="auto", output_loading_info=True
    )
    model, info = loaded
    layout = embedding_layout(model)
    missing = set(info.get("missing_keys", ()))
    embedding = input_weight(model).detach()
    head = None if is_tied(model) else output_weight(model).detach()
    return embedding, head, layout.output_weight not in missing, layout.output_bias not in missing


def _policy(model, tied: bool, embedding: torch.Tensor) -> dict[str, Any]:
    """What the defaults (`UntieCallback()`) would do with the model `from_pretrained` builds, and why, and its
    embedding's share of the parameters: the run's own decision (`untie.decision.decide.decide` on the facts read
    here), said in the words of the run's line at train begin, with a deadline as its setting (the run's length is not
    known here)."""
    from untie.decision.decide import Facts, Settings, decide
    from untie.decision.lines import default_plan_text
    from untie.decision.plan import ModelFacts
    from untie.decision.settings import UntieConfig
    from untie.structure.policy import read_for_policy

    defaults = UntieConfig()
    policy, _ = defaults.chosen_policy()
    reading = read_for_policy(policy, model, tied=tied, peft=False, embedding=embedding)
    facts = Facts(ModelFacts("tied" if tied else "untied"), tied=tied, reading=reading, pairs=True)
    choice = decide(facts, Settings(defaults, "untie inspect")).choice  # the run's own decision, before its first step
    plan = default_plan_text(choice, tied)
    return {
        "embedding_share": choice.embedding_share,
        "parameters": choice.parameters,
        "default": plan,
        "because": choice.reason,
    }


def _text_config(config: Any) -> tuple[str, Any] | None:
    """A multimodal config's text sub-config and its attribute name ("text_config"); None where the text model's
    settings are the config's own."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    if text is None or text is config:
        return None
    names = [name for name in getattr(config, "sub_configs", None) or {} if getattr(config, name, None) is text]
    return (names[0] if names else "text_config"), text


def config_levels(config: Any) -> dict[str, bool | None]:
    """`tie_word_embeddings` at every level of `config` that serving engines read: the top level and, for a
    multimodal model, its text sub-config ("text_config.tie_word_embeddings"); None where a level does not set it."""
    levels = {"tie_word_embeddings": getattr(config, "tie_word_embeddings", None)}
    text = _text_config(config)
    if text is not None:
        levels[f"{text[0]}.tie_word_embeddings"] = getattr(text[1], "tie_word_embeddings", None)
    return levels


def levels_disagree(levels: dict[str, bool | None]) -> bool:
    """Whether the levels of `config_levels` that set the flag do not all say the same."""
    return len({value for value in levels.values() if value is not None}) > 1


def _vocab_size(config: Any) -> int | None:
    """The vocabulary size: the config's own, or its text sub-config's (Gemma 3 multimodal keeps it only there)."""
    size = getattr(config, "vocab_size", None)
    text = _text_config(config)
    return getattr(text[1], "vocab_size", None) if size is None and text is not None else size


def _entry(name: str, weight: torch.Tensor) -> dict[str, Any]:
    return {"name": name, "shape": list(weight.shape), "dtype": str(weight.dtype).removeprefix("torch.")}


def _status(report: dict, declared_tied: bool, head_stored: bool) -> str:
    if report["tied"]:
        return "tied"
    if not head_stored:
        return "head-missing"
    levels = {k: v for k, v in report["config"].items() if k.endswith("tie_word_embeddings")}
    if declared_tied or any(levels.values()):  # a level that an engine may read still declares the tie
        return "untied-fragile"
    return "untied"


def _notes(report: dict) -> list[str]:
    status, name = report["status"], report["output_embedding"]["name"]
    if status == "tied":
        notes = [f"{name} is the input embedding's parameter: one matrix serves both roles."]
        if report["config"][UNTIED_MARKER]:
            notes.append(
                "the config says this library untied it, but the stored head still equals the embedding, so "
                "from_pretrained re-ties them (T5/BART keep tie_word_embeddings=True); untie.untie_embeddings(model) "
                "after loading restores the untie."
            )
        return notes
    if status == "head-missing":
        return [
            f"{name} is not stored and the config does not tie it: from_pretrained initialises the head randomly. "
            "Load with tie_word_embeddings=True, or convert with `untie convert --tie`."
        ]
    if status == "untied-fragile" and not report["config"]["tie_word_embeddings"]:
        return []  # only a sub-config declares the tie: `_level_notes` says which
    if status == "untied-fragile":
        if report["config"][UNTIED_MARKER]:  # untied by this library where the flag cannot be cleared (T5, BART)
            fix = "call untie.untie_embeddings(model) right after loading (the flag also ties encoder and decoder)"
        else:
            fix = "run `untie convert PATH OUT --untie` once, or call untie.untie_embeddings(model) after loading"
        return [
            f"{name} is stored apart and differs, so from_pretrained loads it untied, but the config still declares "
            f"the tie: a later tie_weights() or resize_token_embeddings() silently overwrites the head; {fix}."
        ]
    return [f"{name} is its own parameter; the config does not tie it, so it stays untied through reloads."]


def _level_notes(report: dict) -> list[str]:
    """A multimodal config whose levels disagree on the tie (PEFT's merge and a hand-copied head write only the top
    level): which says what, who reads which, and the fix."""
    levels = {k: v for k, v in report["config"].items() if k.endswith("tie_word_embeddings")}
    if not levels_disagree(levels):
        return []
    said = ", ".join(f"{k}={v}" for k, v in levels.items() if v is not None)
    others = " and ".join(k.removesuffix(".tie_word_embeddings") for k in levels if k != "tie_word_embeddings")
    if report["status"] == "tied":
        effect = (
            f"transformers reads the top level and ties the head to the embedding, but an engine that reads {others} "
            "looks for a head this folder does not store"
        )
        fix = "untie convert PATH OUT --tie"
    elif report["config"]["tie_word_embeddings"]:
        effect = f"the top level re-ties the head in transformers (above), while an engine that reads {others} does not"
        fix = "untie convert PATH OUT --untie"
    else:
        effect = (
            f"transformers reads the top level and keeps the head, but an engine or library that reads {others} "
            "ties it to the embedding again"
        )
        fix = "untie convert PATH OUT --untie"
    return [f"the config's levels disagree ({said}): {effect}. Run `{fix}` once: it writes every level."]


def _token_ids(checkpoint: Checkpoint, pairs: Sequence[tuple[int | str, int | str]]) -> list[tuple[int, int]]:
    """Token pairs as ids: integers as they are, strings through the checkpoint's tokenizer (one token each)."""
    if not pairs:
        return []
    tokenizer = None
    ids: list[tuple[int, int]] = []
    for pair in pairs:
        resolved: list[int] = []
        for token in pair:
            if isinstance(token, int) or (isinstance(token, str) and token.isdigit()):
                resolved.append(int(token))
                continue
            if tokenizer is None:
                tokenizer = _tokenizer(checkpoint, f"look up {token!r}")
            pieces = tokenizer(token, add_special_tokens=False)["input_ids"]
            if len(pieces) != 1:
                raise UntieValueError(
                    f"{token!r} is {len(pieces)} tokens for this tokenizer "
                    f"({tokenizer.convert_ids_to_tokens(pieces)}); a pair needs single tokens. "
                    "Pass token ids, or a word the vocabulary holds whole."
                )
            resolved.append(pieces[0])
        ids.append((resolved[0], resolved[1]))
    vocab = checkpoint.config.get_text_config().vocab_size if hasattr(checkpoint.config, "get_text_config") else None
    for pair in ids:
        if vocab is not None and any(not 0 <= i < vocab for i in pair):
            raise UntieValueError(f"token pair {pair} is outside the vocabulary (0 .. {vocab - 1}).")
    return ids


#: Files a saved tokenizer has at least one of; without any, transformers 5 builds an empty tokenizer of the model type.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _tokenizer(checkpoint: Checkpoint, purpose: str):
    from transformers import AutoTokenizer

    missing = ValueError(
        f"{checkpoint.source} has no tokenizer to {purpose} (none of {', '.join(_TOKENIZER_FILES)}); pass token ids "
        "instead (--pairs 464:262), or save the tokenizer into the folder."
    )
    if checkpoint.is_local and not any(checkpoint.file(name) for name in _TOKENIZER_FILES):
        raise missing
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            checkpoint.source, revision=checkpoint.revision, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise missing from error
    if len(tokenizer) < 2:  # an empty tokenizer built from the model type alone
        raise missing
    return tokenizer


def format_report(report: dict[str, Any]) -> str:
    """The report as a few readable lines (what `untie inspect` prints without --json)."""
    inp, out = report["input_embedding"], report["output_embedding"]
    lines = [
        f"{report['source']}  ({report['model_class']}, model_type {report['model_type']})",
        f"  status:            {report['status']}",
        f"  input embedding:   {inp['name']}  {tuple(inp['shape'])}  {inp['dtype']}",
        f"  output embedding:  {out['name']}  {tuple(out['shape'])}  {out['dtype']}"
        + ("  (shared with the input embedding)" if report["tied"] else ""),
    ]
    bias = report["output_bias"]
    if bias is not None:
        tied_to = f"  (tied to {', '.join(bias['tied_to'])})" if bias["tied_to"] else ""
        lines.append(f"  output bias:       {bias['name']}{tied_to}")
    flags = ", ".join(f"{k}={v}" for k, v in report["config"].items())
    lines.append(f"  config:            {flags}")
    policy = report["policy"]
    lines.append(f"  embedding share:   {policy['embedding_share']:.0%} of {policy['parameters']:,} parameters")
    lines.append(f"  UntieCallback():   {policy['default']}, because {policy['because']}")
    drift = report.get("drift")
    if drift is not None:
        s = drift["sample"]
        lines += [
            f"  drift (sampled: {s['queries']} queries among {s['pool']} tokens, k={s['k']}; CKA on {s['rows']} rows):",
            f"    neighbour overlap: {drift['knn_overlap']:.4f}  (chance {drift['knn_overlap_chance']:.4f}, "
            "identical spaces 1)",
            f"    linear CKA:        {drift['cka']:.4f}  (rows shuffled {drift['cka_shuffled']:.4f}, identical 1)",
        ]
    pairs = report.get("pairs", {})
    if "pairs_from" in report and not pairs:
        lines.append(f"  pairs from the {report['pairs_from']}: none (no case or word-start variants of one token)")
    if "pairs_from" in report and pairs:
        mean_in = sum(d["input"] for d in pairs.values()) / len(pairs)
        mean_out = sum(d["output"] for d in pairs.values()) / len(pairs)
        lines.append(
            f"  pairs from the {report['pairs_from']}: mean input distance {mean_in:.4f}, output {mean_out:.4f}; "
            "the 10 most frequent:"
        )
        pairs = dict(list(pairs.items())[:10])
    for key, d in pairs.items():
        lines.append(f"  pair {key}:  input distance {d['input']:.4f}, output distance {d['output']:.4f}")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    seconds = report["seconds"]
    lines.append(f"  ({report['loaded']} read in {seconds['read']:.2f} s, drift {seconds['drift']:.2f} s)")
    return "\n".join(lines)
