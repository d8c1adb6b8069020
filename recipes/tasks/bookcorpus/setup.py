"""The BookCorpus recipe's settings: its own arguments and presets, resolved with `untie.UntieConfig` and Trainer's
`TrainingArguments` into one `BookCorpusSetup` (`untie_recipes.common`: a preset fills what the command line did not
set)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import transformers as tf

import untie
from untie_recipes.common import RecipeSetup, fill, parse

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

#: Where the recipe's defaults differ from Trainer's and the library's (the paper's optimiser, frequent logs, no
#: logging integration); any of them set on the command line wins.
RECIPE_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/bookcorpus",
    "weight_decay": 0.01,  # AdamW's, on every parameter (paper)
    "adam_epsilon": 1e-12,
    "max_grad_norm": 0.0,  # the paper does not clip
    "logging_steps": 50,
    "report_to": "none",
    "disable_tqdm": False,  # the job's one progress line (Trainer's default hides it when logging is quiet)
    "save_strategy": "no",
    "eval_strategy": "steps",
    "eval_on_start": True,
    "include_num_input_tokens_seen": "non_padding",
    "dataloader_num_workers": 0,
    "use_cpu": not torch.cuda.is_available(),
    "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),  # where the GPU has it
}


@dataclass
class BookCorpusArguments:
    """The recipe's own flags; Trainer's (`--max_steps`, `--learning_rate`, `--seed`, `--output_dir`, `--bf16`,
    `--report_to`, ...) and the untie settings (`--untie_at`, `--metrics_every`, ...) parse beside them."""

    preset: str = field(default="quick", metadata={"help": "quick (offline, minutes on CPU) or paper; see PRESETS."})
    arms: list[str] | None = field(default=None, metadata={"help": f"Arms, from {ARMS} (default: all of them)."})
    objective: str = field(default="mlm", metadata={"help": "mlm (the paper's encoder) or clm (a GPT-2 of its size)."})
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
    threads: int = field(
        default=1,
        metadata={
            "help": "CPU threads for training (torch.set_num_threads). 1 (default): a job never oversubscribes a "
            "machine it shares (with one thread per core, torch's default, another busy process made every step "
            "wait: 2 s a step on 2 cores against 18 min for the whole preset with one), and the numbers do not "
            "depend on the core count. 0: torch's default, one per core (faster on a machine of your own)."
        },
    )
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
    # Optimisation (the rest is Trainer's: --learning_rate, --weight_decay, --max_steps, ...)
    batch_size: int | None = field(default=None, metadata={"help": "Per-device batch size, training and evaluation."})
    lr_min: float = field(default=1e-5, metadata={"help": "Floor of the periodic cosine schedule."})
    cosine_steps: int | None = field(default=None, metadata={"help": "Half-period of the cosine (the paper's T_max)."})
    # Untying (the rest is the library's: --untie_at for the scheduled arm, --metrics_every, ...)
    auto_deadline: float = field(default=0.6, metadata={"help": "auto: untie here if the trigger has not fired."})
    auto_pairs: str = field(
        default="twins",
        metadata={"help": "auto: the pairs the trigger reads: twins (word, twin) or tokenizer (pairs='auto')."},
    )
    # Running
    overwrite: bool = field(default=False, metadata={"help": "Train arms again even if their record exists."})
    report_only: bool = field(default=False, metadata={"help": "Train nothing: report the finished arms."})
    save_model: bool = field(default=False, metadata={"help": "save_pretrained each arm's final model."})


@dataclass(frozen=True)
class BookCorpusSetup(RecipeSetup):
    """Everything the arms run with: the recipe's arguments, the untie settings, Trainer's arguments."""

    args: BookCorpusArguments

    def arm_config(self, arm: str, pairs: Any) -> untie.UntieConfig | None:
        """The arm's untie settings: tied and untied are plain Trainer runs (the baselines the callback's cost is
        measured against); scheduled unties at untie_at without measuring; auto runs the evidence rule on `pairs`,
        with the recipe's deadline."""
        if arm not in ARMS:
            raise ValueError(f"Unknown arm {arm!r}; choose from {ARMS}.")
        if arm in ("tied", "untied"):
            return None
        if arm == "scheduled":  # the schedule as set (policy "off"): the default policy would train untied
            return self.untie.replace(untie_when=None, metrics_every=0, policy="off")
        return self.untie.replace(untie_at=self.args.auto_deadline, untie_when=AUTO_RULE, pairs=pairs, policy="off")


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


def resolve(argv: list[str] | None = None) -> BookCorpusSetup:
    """The recipe's settings from the command line (`argv`; default: the process's), the preset (and its objective's
    sizes) filling what it did not set, checked before anything is trained."""
    (args, config, training), explicit = parse((BookCorpusArguments, untie.UntieConfig, tf.TrainingArguments), argv)
    if args.preset not in PRESETS:
        raise ValueError(f"Unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}.")
    preset = {**PRESETS[args.preset], **OBJECTIVE_PRESETS.get((args.preset, args.objective), {})}
    strategy = preset.pop("train_sampling_strategy")
    values = {k: v for k, v in {**RECIPE_DEFAULTS, **preset, **sampling_arguments(strategy)}.items() if v is not None}
    args = fill(args, values, explicit)
    args = replace(args, arms=args.arms or list(ARMS))
    if args.data_files and args.dataset in (None, "offline", PRESETS[args.preset]["dataset"]):
        args = replace(args, dataset="local")
    derived = {"per_device_train_batch_size": args.batch_size, "per_device_eval_batch_size": args.batch_size}
    setup = BookCorpusSetup(args, fill(config, values, explicit), fill(training, {**values, **derived}, explicit))
    if args.objective not in ("mlm", "clm"):
        raise ValueError(f"--objective {args.objective!r}: choose mlm or clm.")
    if args.streaming and setup.training.max_steps <= 0:
        raise ValueError("--streaming has no length to count epochs over: pass --max_steps.")
    if args.auto_pairs not in ("twins", "tokenizer"):
        raise ValueError(f"--auto_pairs {args.auto_pairs!r}: choose twins or tokenizer.")
    for arm in args.arms:
        setup.arm_config(arm, pairs="auto")  # an unknown arm or a bad setting fails before anything is trained
    return setup
