"""BookCorpus (Bertolotti & Cazzola, ICML 2024, as in the authors' code) with Trainer + UntieCallback, every arm.

    python recipes/bookcorpus.py                              # quick preset, offline: all arms (10-11 min, 2 cores)
    python recipes/bookcorpus.py --arm scheduled              # one arm; the report covers every finished arm
    accelerate launch recipes/bookcorpus.py --preset paper --arm tied   # the paper's run on BookCorpus, 1..N GPUs
    python recipes/bookcorpus.py --report_only                # rebuild the table and figures from finished arms

The paper's masked LM (3 layers, 4 heads, d 128, no positional encoding) learns a corpus in which each of the
100 most common words has a *twin* token drawn in its place on every read. Twins drawn .5/.5 satisfy the
distributional hypothesis; `--twins mixed` (the quick preset) skews every other twin .1/.9, which breaks it. Each
arm records, at every evaluation, the masked-token accuracy and perplexity and the mean Euclidean distance between
word and twin (and between random pairs of different words, the far baseline) in the input and the output space.
`--objective clm` runs the same comparison with a GPT-2 of the same size; its quick preset is shorter
(`OBJECTIVE_PRESETS`: 400 steps of batch 16).

Writes `<output_dir>/arms/<arm>.json` per arm, then `results.json`, `results.md` and `figures/*.png` over every
finished arm in `<output_dir>`. Arms already finished are reused unless `--overwrite`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import datasets
import evaluate
import numpy as np
import torch
import transformers as tf
from accelerate import PartialState

import untie
from untie.metrics import pair_distances
from untie_recipes.progress import JobProgress, quiet_trainer
from untie_recipes.schedules import periodic_cosine
from untie_recipes.tasks.bookcorpus import (
    TwinTable,
    build_twins,
    lm_collator,
    load_corpus,
    load_tokenizer,
    paper_mlm_model,
    small_gpt2,
    tokenize_corpus,
)

ARMS = ("tied", "untied", "scheduled", "auto")
PRESETS = {
    # Offline and CPU-sized: the shipped Shakespeare sentences and the WordPiece vocabulary trained on them,
    # mixed twins (half of them break the DH), 10x the paper's learning rate to move in 1.8k steps, less padding.
    "quick": dict(
        dataset="offline",
        tokenizer="offline",
        twins="mixed",
        init_std=0.02,
        batch_size=64,
        learning_rate=1e-3,
        cosine_steps=600,  # three half-periods: the run ends at the schedule's floor
        num_train_epochs=None,
        max_steps=1_800,
        eval_steps=200,
        max_eval_samples=512,
        train_sampling_strategy="group_by_length",
        metrics_every=50,
    ),
    # The paper's setup (paper.md section 2): BookCorpus (70% / 10% of its train split), bert-base-uncased, twins
    # drawn .5/.5, batch 128, AdamW lr 1e-4, wd 0.01, eps 1e-12, the periodic cosine (T_max 1e4, floor 1e-5), 3 epochs.
    "paper": dict(
        dataset="bookcorpus/bookcorpus",
        tokenizer="bert-base-uncased",
        twins="dh",
        init_std=0.3,
        batch_size=128,
        learning_rate=1e-4,
        cosine_steps=10_000,
        num_train_epochs=3.0,
        max_steps=-1,
        eval_steps=10_000,
        max_eval_samples=20_000,
        train_sampling_strategy="random",
        metrics_every=50,
    ),
}
#: A preset's settings that differ by objective. The quick preset is sized for the MLM; a causal LM's step computes
#: logits at every position (1.9 s at batch 64 on 2 cores: about 57 min an arm), so its quick run is the shortened
#: one the docs validate (docs/recipes/bookcorpus.md, "Causal LM with the tokenizer's pairs"): 400 steps of batch 16,
#: a cosine half-period of 400, a measurement every 25 steps.
OBJECTIVE_PRESETS = {
    ("quick", "clm"): dict(batch_size=16, max_steps=400, cosine_steps=400, metrics_every=25),
}
#: The auto arm's divergence rule, the library's default with pairs (untie.RULES["evidence"]): untie once the model
#: has learned and predicts some pair more than 1 nat apart with significant evidence from the data, i.e. once the
#: distributional hypothesis fails for that pair. The pairs are the (word, twin) pairs, swappable in the input by
#: construction (--auto_pairs twins), or the tokenizer's case and word-start variants (--auto_pairs tokenizer).
AUTO_RULE = untie.RULES["evidence"]


@dataclass
class BookCorpusArguments:
    preset: str = field(default="quick", metadata={"help": "quick (offline, minutes on CPU) or paper; see PRESETS."})
    arm: str = field(default="all", metadata={"help": f"One of {ARMS}, a comma-separated list, or all."})
    objective: str = field(default="mlm", metadata={"help": "mlm (the paper's encoder) or clm (a GPT-2 of its size)."})
    output_dir: str = field(default="runs/bookcorpus", metadata={"help": "Arm records, results and figures go here."})
    # Data
    dataset: str | None = field(
        default=None, metadata={"help": "offline (shipped text), a hub dataset id, or local with --data_files."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "The hub dataset's configuration name."})
    data_files: list[str] | None = field(default=None, metadata={"help": "Local .txt / .json(l) / .parquet / .csv."})
    text_column: str = "text"
    streaming: bool = field(default=False, metadata={"help": "Stream the corpus (needs --max_steps)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set (debugging)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluation examples per evaluation."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "offline (shipped vocab), train (WordPiece on the corpus, cached), or a hub id / path."},
    )
    tokenizer_vocab_size: int = field(default=8192, metadata={"help": "Vocabulary size when --tokenizer train."})
    twins: str | None = field(default=None, metadata={"help": "dh (every twin .5/.5) or mixed (every other .1/.9)."})
    max_length: int = 128
    # Model
    hidden_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 512
    init_std: float | None = field(
        default=None, metadata={"help": "Std of the embedding tables' normal init (paper: 0.3; quick: 0.02)."}
    )
    position_embeddings: bool = field(
        default=False, metadata={"help": "Learned positions in the MLM (the paper has none: a bag of words)."}
    )
    # Optimisation
    batch_size: int | None = field(default=None, metadata={"help": "Per-device batch size."})
    gradient_accumulation_steps: int = 1
    train_sampling_strategy: str | None = field(
        default=None, metadata={"help": "random (the paper) or group_by_length (less padding: ~2x faster on CPU)."}
    )
    learning_rate: float | None = None
    lr_min: float = field(default=1e-5, metadata={"help": "Floor of the periodic cosine schedule."})
    cosine_steps: int | None = field(default=None, metadata={"help": "Half-period of the cosine (the paper's T_max)."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay on every parameter (paper)."})
    adam_epsilon: float = 1e-12
    max_grad_norm: float = field(default=0.0, metadata={"help": "Gradient clipping; the paper does not clip (0)."})
    num_train_epochs: float | None = None
    max_steps: int | None = field(default=None, metadata={"help": "Optimizer steps; -1 = use num_train_epochs."})
    eval_steps: int | None = None
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast (default: on where the GPU has it)."})
    seed: int = 42
    # Untying
    untie_at: float = field(default=0.3, metadata={"help": "scheduled: the untie step, or a fraction of the run."})
    auto_deadline: float = field(default=0.6, metadata={"help": "auto: untie here if the trigger has not fired."})
    metrics_every: int | None = field(
        default=None, metadata={"help": "Steps between role-signal measurements (auto); preset: 50, quick CLM: 25."}
    )
    auto_pairs: str = field(
        default="twins",
        metadata={"help": "auto: the pairs the trigger reads: twins (word, twin) or tokenizer (pairs='auto')."},
    )
    # Running
    overwrite: bool = field(default=False, metadata={"help": "Train arms again even if their record exists."})
    report_only: bool = field(default=False, metadata={"help": "Train nothing: report the finished arms."})
    save_model: bool = field(default=False, metadata={"help": "save_pretrained each arm's final model."})
    logging_steps: int = 50
    report_to: str = field(default="none", metadata={"help": "Trainer logging integrations (tensorboard, wandb)."})
    disable_tqdm: bool = field(
        default=False, metadata={"help": "No progress line for the job: each arm prints its logs instead."}
    )

    def resolved(self) -> BookCorpusArguments:
        """The arguments with every unset field taken from the preset, checked before anything is trained."""
        if self.preset not in PRESETS:
            raise ValueError(f"Unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}.")
        preset = {**PRESETS[self.preset], **OBJECTIVE_PRESETS.get((self.preset, self.objective), {})}
        resolved = replace(self, **{k: v for k, v in preset.items() if getattr(self, k) is None})
        if resolved.data_files and resolved.dataset in (None, "offline", PRESETS[self.preset]["dataset"]):
            resolved = replace(resolved, dataset="local")
        if resolved.objective not in ("mlm", "clm"):
            raise ValueError(f"--objective {resolved.objective!r}: choose mlm or clm.")
        if resolved.streaming and (resolved.max_steps or -1) <= 0:
            raise ValueError("--streaming has no length to count epochs over: pass --max_steps.")
        if resolved.auto_pairs not in ("twins", "tokenizer"):
            raise ValueError(f"--auto_pairs {resolved.auto_pairs!r}: choose twins or tokenizer.")
        resolved.arms()
        return resolved

    def arms(self) -> list[str]:
        names = list(ARMS) if self.arm == "all" else [a.strip() for a in self.arm.split(",") if a.strip()]
        unknown = [a for a in names if a not in ARMS]
        if unknown or not names:
            raise ValueError(f"--arm {self.arm!r}: choose from {ARMS}, a comma-separated list of them, or all.")
        return names


# -- Data --


@dataclass
class PreparedData:
    """What every arm shares: tokenizer, twins, tokenised splits."""

    tokenizer: tf.PreTrainedTokenizerBase
    twins: TwinTable
    train: datasets.Dataset | datasets.IterableDataset
    validation: datasets.Dataset | datasets.IterableDataset

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer) + len(self.twins.twin_ids)


def prepare_data(args: BookCorpusArguments) -> PreparedData:
    """Load, tokenise and twin the corpus. The main process goes first: it trains and caches a `--tokenizer train`
    vocabulary and fills the datasets cache, which the other processes then reuse."""
    state = PartialState()  # under torchrun / accelerate launch this starts the process group Trainer will use
    with state.main_process_first():
        corpus = load_corpus(
            args.dataset,
            dataset_config=args.dataset_config,
            data_files=args.data_files,
            streaming=args.streaming,
            seed=args.seed,
        )
        texts = None
        if args.tokenizer == "train":
            train = corpus["train"]
            texts = (row[args.text_column] for row in (train.take(200_000) if args.streaming else train))
        tokenizer = load_tokenizer(
            args.tokenizer, texts, args.tokenizer_vocab_size, cache_dir=os.path.join(args.output_dir, "tokenizer")
        )
        twins = build_twins(tokenizer, args.twins)
        tokenized = tokenize_corpus(
            corpus, tokenizer, args.objective, args.max_length, args.text_column, args.preprocessing_num_workers
        )
    train, validation = tokenized["train"], tokenized["validation"]
    if args.max_train_samples:  # Dataset.take and IterableDataset.take both stop early on a shorter set
        train = train.take(args.max_train_samples if args.streaming else min(args.max_train_samples, len(train)))
    if args.max_eval_samples:
        validation = validation.take(
            args.max_eval_samples if args.streaming else min(args.max_eval_samples, len(validation))
        )
    return PreparedData(tokenizer, twins, train, validation)


# -- Measurement --


class MaskedTokenAccuracy(evaluate.Metric):
    """Accuracy over labelled positions (label != -100): masked tokens for MLM, next tokens for CLM. A local
    `evaluate` module, so evaluation needs no download."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Accuracy over the positions whose label is not -100.",
            citation="",
            inputs_description="predictions and references: int token ids, -100 references ignored",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean()) if len(references) else float("nan")}


def accuracy_metric(objective: str):
    """compute_metrics for Trainer: predictions arrive as argmax ids (see `preprocess_logits_for_metrics`)."""
    metric = MaskedTokenAccuracy()

    def compute(eval_pred: tf.EvalPrediction) -> dict[str, float]:
        predictions, labels = eval_pred.predictions, eval_pred.label_ids
        if objective == "clm":  # position t predicts token t + 1
            predictions, labels = predictions[:, :-1], labels[:, 1:]
        scored = labels != -100
        return metric.compute(predictions=predictions[scored], references=labels[scored])

    return compute


class TwinDistanceRecorder(tf.TrainerCallback):
    """The paper's measure at every evaluation: mean Euclidean distance word-twin (DH and skewed twins) and between
    random different words, in the input and the output space; with the evaluation's loss, perplexity, accuracy."""

    def __init__(self, twins: TwinTable) -> None:
        self.groups = {
            "twin-dh": twins.pairs_where(skewed=False),
            "twin-skewed": twins.pairs_where(skewed=True),
            "random": twins.random_pairs(),
        }
        self.groups = {name: pairs for name, pairs in self.groups.items() if pairs}
        self.history: list[dict] = []

    def distances(self, model) -> dict[str, dict[str, float]]:
        spaces = {"input": model.get_input_embeddings().weight, "output": model.get_output_embeddings().weight}
        return {
            space: {name: float(np.mean(list(pair_distances(w, p).values()))) for name, p in self.groups.items()}
            for space, w in spaces.items()
        }

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        loss = metrics["eval_loss"]
        self.history.append(
            {
                "step": state.global_step,
                "loss": loss,
                "perplexity": math.exp(min(loss, 50.0)),
                "accuracy": metrics.get("eval_accuracy"),
                "tied": untie.is_tied(model),
                "distances": self.distances(model),
            }
        )


class ThroughputMeter(tf.TrainerCallback):
    """Training tokens per second (non-padding tokens over all ranks), counting only the time between optimizer
    steps: evaluation, logging and checkpointing are left out so arms compare on training work alone."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self._last: float | None = None
        self._tokens_at_last = 0

    def _restart(self, state) -> None:
        self._last, self._tokens_at_last = time.perf_counter(), state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        if self._last is not None:
            self.seconds += time.perf_counter() - self._last
            self.tokens += state.num_input_tokens_seen - self._tokens_at_last
        self._restart(state)

    # The first step (warm-up) is never counted; time spent outside steps restarts the clock.
    def on_evaluate(self, args, state, control, **kwargs):
        self._restart(state)

    def on_log(self, args, state, control, **kwargs):
        self._restart(state)

    def on_save(self, args, state, control, **kwargs):
        self._restart(state)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


# -- One arm --


def arm_callbacks(arm: str, args: BookCorpusArguments, twins: TwinTable) -> tuple[bool, list[tf.TrainerCallback]]:
    """Whether the arm's model starts tied, and its untie callback. tied and untied are plain Trainer runs: the
    baselines that the callback's cost is measured against."""
    if arm in ("tied", "untied"):
        return arm == "tied", []
    if arm == "scheduled":
        return True, [untie.UntieCallback(untie_when=None, untie_at=_step_or_fraction(args.untie_at), metrics_every=0)]
    return True, [
        untie.UntieCallback(
            untie_at=_step_or_fraction(args.auto_deadline),
            untie_when=AUTO_RULE,
            metrics_every=args.metrics_every,
            pairs=twins.pairs if args.auto_pairs == "twins" else "auto",
        )
    ]


def _step_or_fraction(value: float) -> int | float:
    """Command-line numbers arrive as floats: 0 and values >= 1 are steps, the rest fractions of the run."""
    return int(value) if value >= 1 or value == 0 else value


def build_model(args: BookCorpusArguments, vocab_size: int, pad_token_id: int, tied: bool):
    sizes = dict(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
    )
    if args.objective == "clm":
        return small_gpt2(vocab_size, tied=tied, max_length=args.max_length, init_std=args.init_std, **sizes)
    return paper_mlm_model(
        vocab_size,
        tied=tied,
        pad_token_id=pad_token_id,
        position_embeddings=args.position_embeddings,
        max_position_embeddings=args.max_length,
        init_std=args.init_std,
        **sizes,
    )


def launch_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def sampling_arguments(strategy: str) -> dict:
    """TrainingArguments for the sampling order: `train_sampling_strategy` where this transformers has it (later 5.x),
    else the older `group_by_length` flag, which is the same choice between "random" and "group_by_length"."""
    if "train_sampling_strategy" in {f.name for f in fields(tf.TrainingArguments)}:
        return {"train_sampling_strategy": strategy}
    if strategy not in ("random", "group_by_length"):
        raise ValueError(
            f"--train_sampling_strategy {strategy!r} needs a newer transformers (random or group_by_length)."
        )
    return {"group_by_length": strategy == "group_by_length"}


def _training_arguments(arm: str, args: BookCorpusArguments, use_cpu: bool, bf16: bool) -> tf.TrainingArguments:
    """One arm's Trainer arguments (no checkpoints; evaluations every `eval_steps`, from step 0)."""
    return tf.TrainingArguments(
        output_dir=os.path.join(args.output_dir, "checkpoints", arm),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        **sampling_arguments(args.train_sampling_strategy),
        max_steps=args.max_steps,
        num_train_epochs=args.num_train_epochs or 1.0,
        max_grad_norm=args.max_grad_norm,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        eval_on_start=True,
        logging_steps=args.logging_steps,
        save_strategy="no",
        include_num_input_tokens_seen="non_padding",
        report_to=args.report_to,
        run_name=f"bookcorpus-{args.objective}-{arm}",
        disable_tqdm=args.disable_tqdm,
        seed=args.seed,
        bf16=bf16,
        use_cpu=use_cpu,
        dataloader_num_workers=0,
    )


def _arm_record(arm: str, args: BookCorpusArguments, data: PreparedData, trainer: tf.Trainer, callback,
                recorder: TwinDistanceRecorder, meter: ThroughputMeter, runtime: float) -> dict:  # fmt: skip
    """The arm's record: its summary, its untie, its throughput and its histories."""
    final = recorder.history[-1]
    trigger = callback.divergence if callback else None
    return {
        "arm": arm,
        "objective": args.objective,
        "twins": args.twins,
        "dataset": args.dataset,
        "steps": trainer.state.global_step,
        "untie_step": callback.untie_step if callback else None,
        "untie_reason": callback.untie_reason if callback else None,
        "trigger_step": trigger.fired_step if trigger else None,
        "trigger_pairs": _named_pairs(trigger.fired_pairs, data.tokenizer, data.twins) if trigger else [],
        "eval_loss": final["loss"],
        "perplexity": final["perplexity"],
        "accuracy": final["accuracy"],
        "distances": final["distances"],
        "tokens_per_second": meter.tokens_per_second,
        "train_tokens": trainer.state.num_input_tokens_seen,
        "runtime_s": round(runtime, 1),
        "world_size": trainer.args.world_size,
        "bf16": trainer.args.bf16,
        "history": {
            "eval": recorder.history,
            "train": [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e],
            "signals": callback.history if callback else [],
        },
        "settings": {k: v for k, v in asdict(args).items() if k != "arm"},
    }


def train_arm(
    arm: str, args: BookCorpusArguments, data: PreparedData, progress: JobProgress | None = None
) -> tuple[dict, tf.Trainer]:
    """Train one arm; return its record (summary + histories) and the trainer. `progress` is the job's progress line
    (None keeps Trainer's own bar, or its log printer with --disable_tqdm)."""
    tied, callbacks = arm_callbacks(arm, args, data.twins)
    tf.set_seed(args.seed)  # every arm starts from the same input table and sees the same data draws
    model = build_model(args, data.vocab_size, data.tokenizer.pad_token_id, tied)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, eps=args.adam_epsilon
    )
    scheduler = periodic_cosine(optimizer, args.learning_rate, args.lr_min, args.cosine_steps)
    recorder, meter = TwinDistanceRecorder(data.twins), ThroughputMeter()
    use_cpu = not torch.cuda.is_available()
    bf16 = args.bf16 if args.bf16 is not None else (not use_cpu and torch.cuda.is_bf16_supported())
    training = _training_arguments(arm, args, use_cpu, bf16)
    trainer = tf.Trainer(
        model=model,
        args=training,
        train_dataset=data.train,
        eval_dataset=data.validation,
        processing_class=data.tokenizer,  # pairs="auto" (--auto_pairs tokenizer) reads its vocabulary
        data_collator=lm_collator(data.tokenizer, args.objective, data.twins, seed=args.seed + 1000 * launch_rank()),
        optimizers=(optimizer, scheduler),
        compute_metrics=accuracy_metric(args.objective),
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        callbacks=[*callbacks, recorder, meter],
    )
    if progress is not None:
        quiet_trainer(trainer)
        trainer.add_callback(progress.callback(arm))
    started = time.perf_counter()
    trainer.train()
    if recorder.history[-1]["step"] != trainer.state.global_step:  # the last step was not an eval step
        trainer.evaluate()
    runtime = time.perf_counter() - started
    callback = callbacks[0] if callbacks else None
    record = _arm_record(arm, args, data, trainer, callback, recorder, meter, runtime)
    if trainer.is_world_process_zero():
        path = Path(args.output_dir, "arms", f"{arm}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)  # a reader never sees half a record
        if args.save_model:
            trainer.save_model(os.path.join(args.output_dir, "models", arm))
    return record, trainer


def _named_pairs(keys: list[str], tokenizer, twins: TwinTable) -> list[str]:
    """Pair keys ("12-8201") as tokens ("the/the'"), a twin written as its word with a prime."""
    twin_of = {twin: word for word, twin in twins.pairs}

    def token(token_id: int) -> str:
        if token_id in twin_of:
            return tokenizer.convert_ids_to_tokens(twin_of[token_id]) + "'"
        return tokenizer.convert_ids_to_tokens(token_id)

    return [f"{token(int(a))}/{token(int(b))}" for a, b in (key.split("-") for key in keys)]


# -- Report --


def load_records(output_dir: str) -> list[dict]:
    """Every finished arm in output_dir, in ARMS order."""
    records = {p.stem: json.loads(p.read_text()) for p in Path(output_dir, "arms").glob("*.json")}
    return [records[arm] for arm in ARMS if arm in records]


def markdown_table(records: list[dict]) -> str:
    tied = next((r for r in records if r["arm"] == "tied"), None)
    groups = [g for g in ("twin-dh", "twin-skewed", "random") if g in records[0]["distances"]["input"]]
    head = ["arm", "untie step", "eval loss", "perplexity", "accuracy"]
    head += [f"{g} in / out" for g in groups] + ["tokens/s", "vs tied"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        untie_cell = "-" if r["untie_step"] is None else f"{r['untie_step']} ({r['untie_reason']})"
        ratio = r["tokens_per_second"] / tied["tokens_per_second"] if tied else float("nan")
        cells = [r["arm"], untie_cell, f"{r['eval_loss']:.3f}", f"{r['perplexity']:.1f}", f"{r['accuracy']:.3f}"]
        cells += [f"{r['distances']['input'][g]:.2f} / {r['distances']['output'][g]:.2f}" for g in groups]
        cells += [f"{r['tokens_per_second']:.0f}", f"{ratio:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    first = records[0]
    lines += [
        "",
        f"Objective {first['objective']}, twins {first['twins']}, dataset {first['dataset']}, {first['steps']} steps. "
        "Distances are mean Euclidean distances word-twin (twin-dh: drawn .5/.5; twin-skewed: .1/.9) and between "
        "random different common words, in the input / output table at the end. tokens/s counts training steps "
        "only; 'vs tied' is the ratio to the tied arm of the same report.",
    ]
    return "\n".join(lines) + "\n"


def write_figures(records: list[dict], figures_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figures_dir, exist_ok=True)
    written = []

    def mark_untie(ax, record: dict) -> None:
        if record["untie_step"] is not None:
            ax.axvline(record["untie_step"], color="grey", linestyle=":", linewidth=1)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in records:
        steps = [e["step"] for e in r["history"]["eval"]]
        for ax, key in zip(axes, ("loss", "accuracy"), strict=True):
            ax.plot(steps, [e[key] for e in r["history"]["eval"]], marker=".", label=r["arm"])
    for ax, title in zip(axes, ("eval loss", "eval accuracy (masked / next token)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(os.path.join(figures_dir, "curves.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    styles = {"twin-dh": "-", "twin-skewed": "--", "random": ":"}
    fig, axes = plt.subplots(2, len(records), figsize=(3.6 * len(records), 6), sharey=True, squeeze=False)
    for column, r in enumerate(records):
        steps = [e["step"] for e in r["history"]["eval"]]
        for row, space in enumerate(("input", "output")):
            ax = axes[row][column]
            for group, style in styles.items():
                if group in r["distances"][space]:
                    values = [e["distances"][space][group] for e in r["history"]["eval"]]
                    ax.plot(steps, values, linestyle=style, label=group)
            mark_untie(ax, r)
            ax.set_title(f"{r['arm']}: {space}" + (" (= tied)" if r["arm"] == "tied" else ""), fontsize=9)
            ax.set_xlabel("step")
    axes[0][0].set_ylabel("mean distance")
    axes[1][0].set_ylabel("mean distance")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    written.append(os.path.join(figures_dir, "distances.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def report(output_dir: str) -> dict:
    """results.json, results.md and figures over every finished arm in output_dir."""
    records = load_records(output_dir)
    if not records:
        raise FileNotFoundError(f"No finished arms in {output_dir}/arms: train one first (drop --report_only).")
    tied = next((r for r in records if r["arm"] == "tied"), None)
    summary = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in ("history", "settings")}
        row["throughput_vs_tied"] = r["tokens_per_second"] / tied["tokens_per_second"] if tied else None
        summary.append(row)
    results = {"arms": summary}
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2))
    table = markdown_table(records)
    Path(output_dir, "results.md").write_text(table)
    figures = write_figures(records, os.path.join(output_dir, "figures"))
    print(table)
    print(f"Wrote {output_dir}/results.json, results.md and {len(figures)} figures in {output_dir}/figures")
    return results


def main(argv: list[str] | None = None) -> dict:
    (args,) = tf.HfArgumentParser(BookCorpusArguments).parse_args_into_dataclasses(args=argv)
    args = args.resolved()
    os.makedirs(args.output_dir, exist_ok=True)
    if not args.report_only:
        todo = [a for a in args.arms() if args.overwrite or not Path(args.output_dir, "arms", f"{a}.json").exists()]
        if todo:
            data = prepare_data(args)
            progress = None
            if not args.disable_tqdm:  # one line for every arm; its length comes from the first arm's max_steps
                progress = JobProgress(len(todo), None, description="BookCorpus", disable=launch_rank() != 0)
            try:
                for arm in todo:
                    train_arm(arm, args, data, progress)
            finally:
                if progress:
                    progress.close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return report(args.output_dir) if launch_rank() == 0 else {}


if __name__ == "__main__":
    main()
