"""What plain transformers / PEFT do on each fine-tuning route of a tied checkpoint, and what `untie` changes, measured
on tiny tied checkpoints pretrained on the shipped text (issue 69): the table of docs/guides/tied-checkpoints.md.

    python scripts/route_table.py --output_dir runs/route-table

Three tiny tied checkpoints are pretrained for `--pretrain_steps` AdamW steps on the offline Shakespeare corpus (its
8,192-token WordPiece vocabulary): a Qwen3-shaped model whose matrix is padded past the tokenizer (8,256 rows, as
Qwen3 and Gemma 3 pad theirs), a Llama 3.2-shaped one with one row per token, and a multimodal Gemma 3
(`Gemma3ForConditionalGeneration`, with a vision tower). Each route then starts from a saved checkpoint:

- full fine-tune: `untie.untie_embeddings` against the two-line manual copy, `--steps` AdamW steps each, every
  parameter and the logits compared; `from_pretrained(..., tie_word_embeddings=False)` against the copy: how far the
  logits start and the loss of the first batch (and the last);
- LoRA on the attention projections (what TRL's `peft_config` builds), without and with `modules_to_save` on both
  matrices: the merged models of a run untied first and of one not, compared;
- new tokens: where two added ids land on the padded and on the exact matrix, with `resize_token_embeddings(
  len(tokenizer))` and with the guide's recipe (never shrink, rows at the known tokens' mean, then untie);
- multimodal: the `tie_word_embeddings` of each config level that PEFT's merge, the manual copy and the library save;
- a fragile folder: the manual copy without its second line, fine-tuned and saved: what `untie inspect` says, how far
  a plain `tie_weights()` moves its logits, and the same after `untie convert --untie`;
- serving: the parameters and bfloat16 bytes an untied head adds, from the published shapes of three checkpoints
  (built on the meta device: nothing is downloaded or allocated).

Writes results.json (every figure) and results.md (the table) to `--output_dir`. One thread, float32: the same numbers
on every run on one CPU kind.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import tempfile
import warnings
from pathlib import Path

import torch
import transformers as tf
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "recipes" / "tasks" / "bookcorpus" / "shakespeare.txt.gz"
VOCABULARY = ROOT / "recipes" / "tasks" / "bookcorpus" / "shakespeare-vocab.txt"
PADDED_ROWS = 8256  # the 8,192-token vocabulary padded to the next multiple of 64, as Qwen3 and Gemma 3 pad theirs
NEW_TOKENS = ["<|sql_start|>", "<|sql_end|>"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

#: Published shapes of today's small tied checkpoints (their config.json): vocabulary, hidden size, and what the rest of
#: the model needs to count its parameters.
PUBLISHED = {
    "Qwen3-0.6B": (
        tf.Qwen3ForCausalLM,
        lambda: tf.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    ),
    "Gemma 3 1B": (
        tf.Gemma3ForCausalLM,
        lambda: tf.Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=256),
    ),
    "Llama 3.2 1B": (
        tf.LlamaForCausalLM,
        lambda: tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    ),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/route-table", help="where results.json and results.md go")
    parser.add_argument("--pretrain_steps", type=int, default=200, help="AdamW steps of each tied checkpoint (200)")
    parser.add_argument("--steps", type=int, default=20, help="fine-tuning steps of each route (20)")
    parser.add_argument("--lines", type=int, default=4000, help="lines of the shipped corpus to tokenize (4000)")
    parser.add_argument("--hidden_size", type=int, default=64, help="the tiny models' width (64)")
    parser.add_argument("--layers", type=int, default=2, help="the tiny models' decoder layers (2)")
    parser.add_argument("--seq_len", type=int, default=32, help="tokens per sequence (32)")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per step (8)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every model, draw and batch order (0)")
    return parser.parse_args(argv)


# -- data, checkpoints -------------------------------------------------------------------------------------------------


def tokenizer() -> tf.PreTrainedTokenizerBase:
    """The shipped uncased WordPiece vocabulary of the offline corpus (8,192 tokens, [PAD] = 0)."""
    tokens = VOCABULARY.read_text(encoding="utf-8").splitlines()
    return tf.BertTokenizer(vocab={token: i for i, token in enumerate(tokens)}, do_lower_case=True)


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """The first `--lines` lines of the corpus as one token stream, cut into `--seq_len` blocks, shuffled with the
    seed, in batches of `--batch_size`."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as corpus:
        lines = [line for _, line in zip(range(args.lines), corpus, strict=False)]
    ids = [i for row in tokenizer()(lines, add_special_tokens=False)["input_ids"] for i in row]
    blocks = torch.tensor(ids[: len(ids) // args.seq_len * args.seq_len]).view(-1, args.seq_len)
    blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(args.seed))]
    return list(blocks[: len(blocks) // args.batch_size * args.batch_size].split(args.batch_size))


def _text(args: argparse.Namespace, vocab_size: int) -> dict:
    heads = max(2, args.hidden_size // 16)
    return dict(vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                head_dim=args.hidden_size // heads, max_position_embeddings=2 * args.seq_len, pad_token_id=0,
                bos_token_id=2, eos_token_id=3)  # fmt: skip


#: name -> (a tied model built from config, the class that reloads it)
def checkpoints(args: argparse.Namespace) -> dict:
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    return {
        "qwen3-padded": (lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_text(args, PADDED_ROWS),
                                                                    tie_word_embeddings=True)),
                         tf.AutoModelForCausalLM),
        "llama-3.2-exact": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_text(args, len(tokenizer())),
                                                                       tie_word_embeddings=True)),
                            tf.AutoModelForCausalLM),
        "gemma3-multimodal": (lambda: tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=_text(args, PADDED_ROWS), vision_config=vision, mm_tokens_per_image=4,
            image_token_index=PADDED_ROWS - 1, boi_token_index=PADDED_ROWS - 2, eoi_token_index=PADDED_ROWS - 3)),
                              tf.AutoModelForImageTextToText),
    }  # fmt: skip


def train(model: nn.Module, data: list[torch.Tensor], steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps on `data` (cycled); the loss of each batch before its step."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        ids = data[step % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def distance(first: torch.Tensor, second: torch.Tensor) -> float:
    return (first.float() - second.float()).abs().max().item()


def largest_parameter_difference(first: nn.Module, second: nn.Module) -> float:
    """The largest entry-wise difference over every tensor of the two state dicts (which must hold the same names)."""
    a, b = first.state_dict(), second.state_dict()
    if a.keys() != b.keys():
        raise ValueError(f"the two models hold different tensors: {sorted(a.keys() ^ b.keys())}")
    return max(distance(a[name], b[name]) for name in a)


def manual_copy(model: tf.PreTrainedModel, flag: bool = True) -> None:
    """The two lines a user writes (`flag=False`: the first only)."""
    model.lm_head.weight = nn.Parameter(model.get_input_embeddings().weight.clone())
    if flag:
        model.config.tie_word_embeddings = False


def saved_levels(folder: Path) -> dict[str, bool | None]:
    """`tie_word_embeddings` of each level of a saved config.json (None: the level does not say)."""
    config = json.loads((folder / "config.json").read_text())
    levels = {"top": config.get("tie_word_embeddings")}
    if "text_config" in config:
        levels["text_config"] = config["text_config"].get("tie_word_embeddings")
    return levels


def head_stored(folder: Path) -> bool:
    """Whether the saved weights hold the head (a tied checkpoint stores the embedding alone)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return "lm_head.weight" in weights.keys()


def cli(*argv: str) -> dict:
    """`untie ARGV --json`, its JSON report."""
    from untie.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    report = json.loads(out.getvalue())
    if code != 0:
        raise RuntimeError(f"untie {' '.join(argv)} exited {code}: {report}")
    return report


# -- routes ------------------------------------------------------------------------------------------------------------


def full_finetune(folder: Path, data: list[torch.Tensor], probe: torch.Tensor, args) -> dict:
    import untie

    copy = tf.AutoModelForCausalLM.from_pretrained(folder)
    manual_copy(copy)
    library = tf.AutoModelForCausalLM.from_pretrained(folder)
    untie.untie_embeddings(library)
    torch.manual_seed(args.seed)
    drawn = tf.AutoModelForCausalLM.from_pretrained(folder, tie_word_embeddings=False)
    at_load = distance(logits(drawn, probe), logits(copy, probe))
    drawn_equals_embedding = torch.equal(drawn.lm_head.weight, drawn.get_input_embeddings().weight)
    before = logits(copy, probe)
    losses = {name: train(model, data, args.steps, 1e-3) for name, model in
              (("copy", copy), ("library", library), ("drawn", drawn))}  # fmt: skip
    return {
        "steps": args.steps,
        "library_vs_copy_parameters": largest_parameter_difference(library, copy),
        "library_vs_copy_logits": distance(logits(library, probe), logits(copy, probe)),
        "checkpoint_stores_head": head_stored(folder),
        "drawn_head_equals_embedding": drawn_equals_embedding,
        "copy_logits_moved_by_finetune": distance(logits(copy, probe), before),
        "drawn_vs_copy_logits_at_load": at_load,
        "first_loss": {name: values[0] for name, values in losses.items()},
        "last_loss": {name: values[-1] for name, values in losses.items()},
    }


def lora(folder: Path, data: list[torch.Tensor], probe: torch.Tensor, args) -> dict:
    import peft

    import untie

    results = {}
    for name, modules in (("attention", None), ("attention_and_both_matrices", ["embed_tokens", "lm_head"])):
        merged = {}
        for untie_first in (False, True):
            model = tf.AutoModelForCausalLM.from_pretrained(folder)
            if untie_first:
                untie.untie_embeddings(model)
            torch.manual_seed(args.seed)  # the LoRA matrices' draw
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, modules_to_save=modules)
            wrapped = peft.get_peft_model(model, config)
            train(wrapped, data, args.steps, 1e-3)
            merged[untie_first] = wrapped.merge_and_unload()
        tied, untied = merged[False], merged[True]
        results[name] = {
            "modules_to_save": modules,
            "merged_parameters": largest_parameter_difference(untied, tied),
            "merged_logits": distance(logits(untied, probe), logits(tied, probe)),
            "merged_tied_without_untie": untie.is_tied(tied),
            "merged_flag_without_untie": tied.config.get_text_config().tie_word_embeddings,
        }
    return results


def new_tokens(folder: Path) -> dict:
    """Two new tokens on a tied checkpoint of `rows` rows: plain `resize_token_embeddings(len(tokenizer))`, and the
    guide's recipe."""
    import untie

    text = tokenizer()
    known = len(text)
    assert text.add_tokens(NEW_TOKENS) == len(NEW_TOKENS)
    ids = text.convert_tokens_to_ids(NEW_TOKENS)
    before = tf.AutoModelForCausalLM.from_pretrained(folder).get_input_embeddings().weight.detach()
    mean = before[:known].mean(dim=0)

    plain = tf.AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)  # mean_resizing draws the added rows
    plain.resize_token_embeddings(len(text))
    plain_rows = plain.get_input_embeddings().weight.detach()
    result = {
        "tokenizer": known,
        "new_ids": ids,
        "rows_before": before.shape[0],
        "plain_rows_after": plain_rows.shape[0],
        "plain_from_old_rows": distance(plain_rows[ids], before[ids]) if before.shape[0] > max(ids) else None,
        "plain_from_mean": distance(plain_rows[ids], mean.expand(len(ids), -1)),
    }

    guided = tf.AutoModelForCausalLM.from_pretrained(folder)
    if len(text) > guided.get_input_embeddings().weight.shape[0]:
        guided.resize_token_embeddings(len(text), pad_to_multiple_of=64, mean_resizing=True)
    with torch.no_grad():
        weight = guided.get_input_embeddings().weight
        weight[ids] = weight[:known].mean(dim=0)
    untie.untie_embeddings(guided)
    embedding, head = guided.get_input_embeddings().weight.detach(), guided.get_output_embeddings().weight.detach()
    result.update(
        guide_rows_after=embedding.shape[0],
        guide_known_rows_kept=torch.equal(embedding[:known], before[:known]),
        guide_from_mean=max(distance(w[ids], mean.expand(len(ids), -1)) for w in (embedding, head)),
        guide_untied=not untie.is_tied(guided),
    )
    return result


def multimodal(folder: Path, out: Path, data: list[torch.Tensor], probe: torch.Tensor, args) -> dict:
    """Gemma 3 multimodal: the config levels each route saves, what `untie inspect` says of each folder, and how far
    the logits move when the head is tied back to the embedding (what a reader of a level that says tied does)."""
    import peft

    import untie

    results = {}
    for route in ("peft_merge", "manual_copy", "untie_embeddings"):
        model = tf.AutoModelForImageTextToText.from_pretrained(folder)
        if route == "peft_merge":
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)",
                                     modules_to_save=["embed_tokens", "lm_head"])  # fmt: skip
            torch.manual_seed(args.seed)
            wrapped = peft.get_peft_model(model, config)
            train(wrapped, data, args.steps, 1e-3)
            model = wrapped.merge_and_unload()
        else:
            if route == "manual_copy":
                manual_copy(model)
            else:
                untie.untie_embeddings(model)
            train(model, data, args.steps, 1e-3)
        model.save_pretrained(out / route)
        trained = logits(model, probe)
        reloaded = tf.AutoModelForImageTextToText.from_pretrained(out / route)
        reloaded.tie_weights()
        reload_difference = distance(logits(reloaded, probe), trained)
        with torch.no_grad():
            reloaded.get_output_embeddings().weight = reloaded.get_input_embeddings().weight
        results[route] = {
            "levels": saved_levels(out / route),
            "inspect": cli("inspect", str(out / route), "--queries", "64", "--pool", "1024")["status"],
            "plain_reload_and_tie_weights": reload_difference,
            "tied_back": distance(logits(reloaded, probe), trained),
        }
    return results


def fragile(folder: Path, out: Path, data: list[torch.Tensor], probe: torch.Tensor, args) -> dict:
    """The manual copy without its second line, fine-tuned and saved: the head stored apart, the config still tied."""
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    manual_copy(model, flag=False)
    train(model, data, args.steps, 1e-3)
    trained = logits(model, probe)
    model.save_pretrained(out / "fragile")
    result = {"levels": saved_levels(out / "fragile"), "head_stored": head_stored(out / "fragile")}
    for name, path in (("fragile", out / "fragile"), ("converted", out / "converted")):
        if name == "converted":
            result["convert"] = cli("convert", str(out / "fragile"), str(path), "--untie")["after"]
        reloaded = tf.AutoModelForCausalLM.from_pretrained(path)
        at_load = distance(logits(reloaded, probe), trained)
        reloaded.tie_weights()
        result[name] = {
            "inspect": cli("inspect", str(path), "--queries", "64", "--pool", "1024")["status"],
            "plain_reload": at_load,
            "after_tie_weights": distance(logits(reloaded, probe), trained),
        }
    return result


def serving() -> dict:
    """Per published checkpoint: its parameters tied, what an untied head adds, in parameters and bfloat16 bytes."""
    results = {}
    for name, (model_class, config) in PUBLISHED.items():
        with torch.device("meta"):
            model = model_class(config())
        tied = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter, counted once
        rows, hidden = model.get_input_embeddings().weight.shape
        results[name] = {"vocab_size": rows, "hidden_size": hidden, "parameters_tied": tied,
                         "head_parameters": rows * hidden, "head_bf16_mb": rows * hidden * 2 / 1e6}  # fmt: skip
    return results


# -- the table ---------------------------------------------------------------------------------------------------------


def _g(value: float) -> str:
    return "0.0" if value == 0 else f"{value:.3g}"


def _levels(levels: dict) -> str:
    return ", ".join(f"{'`text_config`' if level == 'text_config' else 'top'} {value}" for level, value in
                     levels.items())  # fmt: skip


def _new_tokens_rows(padded: dict, exact: dict) -> list[str]:
    rows = []
    for t, shape in ((padded, "Qwen3-shaped"), (exact, "Llama 3.2-shaped")):
        ids = f"{t['new_ids'][0]:,}-{t['new_ids'][1]:,}"
        if t["plain_from_old_rows"] is None:
            where = f"new ids {ids} on added rows, drawn near the mean (`mean_resizing`)"
            plain_figure = f"plain: new rows {_g(t['plain_from_mean'])} from the known tokens' mean"
        else:
            same = "on the old padding rows" if t["plain_from_old_rows"] == 0 else "on rows rewritten"
            where = f"new ids {ids} land {same}"
            plain_figure = (f"plain: new rows {_g(t['plain_from_old_rows'])} from the old padding rows, "
                            f"{_g(t['plain_from_mean'])} from the known tokens' mean")  # fmt: skip
        kept = "old rows kept" if t["guide_known_rows_kept"] else "**old rows changed**"
        untied = "untied" if t["guide_untied"] else "**still tied**"
        rows.append(
            f"| new tokens, {shape} ({t['rows_before']:,} rows, {t['tokenizer']:,} tokens) | "
            f"`resize_token_embeddings(len(tokenizer))`: {t['rows_before']:,} → {t['plain_rows_after']:,} rows, "
            f"{where} | the guide: never shrink ({t['rows_before']:,} → {t['guide_rows_after']:,} rows, {kept}), new "
            f"rows at the known tokens' mean, then {untied} | {plain_figure}; the guide: "
            f"{_g(t['guide_from_mean'])} from the mean, both roles |"
        )  # fmt: skip
    return rows


def table(results: dict) -> str:
    full, lora_runs, tokens = results["full_finetune"], results["lora"], results["new_tokens"]
    mm, frag, serve = results["multimodal"], results["fragile"], results["serving"]
    steps = full["steps"]
    first, last = full["first_loss"], full["last_loss"]
    stores = "stores a head" if full["checkpoint_stores_head"] else "stores no head"
    drawn = "a fresh one is drawn" if not full["drawn_head_equals_embedding"] else "**the embedding is copied**"
    lora_rows = []
    for name, title in (
        ("attention", "LoRA on q/k/v/o (as TRL's `peft_config`)"),
        ("attention_and_both_matrices", 'LoRA + `modules_to_save=["embed_tokens", "lm_head"]`'),
    ):
        run = lora_runs[name]
        plain = (
            "the merged model stays tied"
            if run["merged_tied_without_untie"]
            else f"PEFT gives each matrix a copy; its merge saves tied={run['merged_flag_without_untie']}"
        )
        lora_rows.append(
            f"| {title} | {plain} | untie first: the head a matrix of its own | merged, untied first vs not: "
            f"max \\|Δ\\| {_g(run['merged_parameters'])} (weights), {_g(run['merged_logits'])} (logits) |"
        )  # fmt: skip
    statuses = ", ".join(r["inspect"] for r in mm.values())
    reloads = max(r["plain_reload_and_tie_weights"] for r in mm.values())
    sizes = "; ".join(
        f"{name} ({s['vocab_size']:,} x {s['hidden_size']:,}): +{s['head_parameters'] / 1e6:.1f}M parameters "
        f"(+{100 * s['head_parameters'] / s['parameters_tied']:.0f}%), {s['head_bf16_mb']:.0f} MB in bfloat16"
        for name, s in serve.items()
    )
    rows = [
        "| route | plain transformers / PEFT | what the library changes | measured |",
        "|---|---|---|---|",
        "| full fine-tune | the two-line copy: `lm_head.weight = nn.Parameter(embedding.clone())`, "
        "`tie_word_embeddings = False` | `untie.untie_embeddings(model)`: the same copy, every config level | "
        f"library vs copy after {steps} AdamW steps: max \\|Δ\\| {_g(full['library_vs_copy_parameters'])} "
        f"(every parameter), {_g(full['library_vs_copy_logits'])} (logits) |",
        f"| full fine-tune, the flag at load | `from_pretrained(..., tie_word_embeddings=False)`: the checkpoint "
        f"{stores}, so {drawn} | the head starts as the embedding's copy | logits "
        f"{_g(full['drawn_vs_copy_logits_at_load'])} from the copy's (max \\|Δ\\|; {steps} steps move the copy's by "
        f"{_g(full['copy_logits_moved_by_finetune'])}); first batch's loss "
        f"{first['drawn']:.2f} vs {first['copy']:.2f} nat (+{first['drawn'] - first['copy']:.2f}); after {steps} "
        f"steps {last['drawn']:.2f} vs {last['copy']:.2f} |",
        *lora_rows,
        *_new_tokens_rows(tokens["qwen3-padded"], tokens["llama-3.2-exact"]),
        f"| multimodal (Gemma 3, `Gemma3ForConditionalGeneration`) | PEFT's merge saves "
        f"{_levels(mm['peft_merge']['levels'])}; the two-line copy {_levels(mm['manual_copy']['levels'])} | "
        f"`untie_embeddings` saves {_levels(mm['untie_embeddings']['levels'])} | `untie inspect` on the three: "
        f"{statuses}; plain reload + `tie_weights()`: max \\|Δ\\| {_g(reloads)} on each; tying the head back, as "
        f"a reader of `text_config` would, moves PEFT's logits by {_g(mm['peft_merge']['tied_back'])} |",
        f"| a fragile folder: the copy without its second line, fine-tuned, saved (config "
        f"{_levels(frag['levels'])}, head {'stored' if frag['head_stored'] else '**not stored**'}) | loads right "
        f"(max \\|Δ\\| {_g(frag['fragile']['plain_reload'])}); "
        f"a plain `tie_weights()` moves its logits by {_g(frag['fragile']['after_tie_weights'])} | `untie inspect`: "
        f"{frag['fragile']['inspect']}; `untie convert --untie` writes the config | after the convert: "
        f"{frag['convert']}, inspect {frag['converted']['inspect']}, reload + `tie_weights()` max \\|Δ\\| "
        f"{_g(frag['converted']['after_tie_weights'])} |",
        f"| serving | tied: the matrix stored and served once | untied: one matrix more | {sizes} |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reductions whatever the machine's core count
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="route-table-") as scratch:
            warnings.simplefilter("ignore")
            results = _measure(args, Path(scratch))
    finally:
        torch.set_num_threads(threads)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(
        "# What the library adds, per route\n\n"
        f"Tiny tied checkpoints (width {args.hidden_size}, {args.layers} layers) pretrained {args.pretrain_steps} "
        f"steps on the shipped text, {args.steps} fine-tuning steps per route; transformers {tf.__version__}, "
        f"peft {results['versions']['peft']}, torch {torch.__version__}.\n\n{table(results)}\n"
    )
    print(table(results))
    return results


def _measure(args: argparse.Namespace, scratch: Path) -> dict:
    import peft

    data = batches(args)
    pretrain, finetune, probe = data[: len(data) // 2], data[len(data) // 2 : -1], data[-1]
    folders = {}
    pretrained = {}
    for name, (build, _) in checkpoints(args).items():
        torch.manual_seed(args.seed)
        model = build()
        losses = train(model, pretrain, args.pretrain_steps, 3e-3)
        pretrained[name] = {"first_loss": losses[0], "last_loss": losses[-1]} if losses else {}
        folders[name] = scratch / name
        model.save_pretrained(folders[name])
    return {
        "versions": {"transformers": tf.__version__, "peft": peft.__version__, "torch": torch.__version__},
        "settings": vars(args),
        "pretrained": pretrained,
        "full_finetune": full_finetune(folders["qwen3-padded"], finetune, probe, args),
        "lora": lora(folders["qwen3-padded"], finetune, probe, args),
        "new_tokens": {name: new_tokens(folders[name]) for name in ("qwen3-padded", "llama-3.2-exact")},
        "multimodal": multimodal(folders["gemma3-multimodal"], scratch, finetune, probe, args),
        "fragile": fragile(folders["qwen3-padded"], scratch, finetune, probe, args),
        "serving": serving(),
    }


if __name__ == "__main__":
    main()
