"""The paper's BookCorpus experiment: corpora, tokenizer, twin tokens and models, importable by recipes and tests."""

from untie_recipes.tasks.bookcorpus.data import (
    COMMON_WORDS,
    OFFLINE_CORPUS,
    TWIN_VARIANTS,
    TwinSwapCollator,
    TwinTable,
    build_twins,
    lm_collator,
    load_corpus,
    load_tokenizer,
    offline_sentences,
    tokenize_corpus,
)
from untie_recipes.tasks.bookcorpus.modeling import (
    TwinEncoderConfig,
    TwinEncoderForMaskedLM,
    paper_mlm_model,
    small_gpt2,
)

__all__ = [
    "COMMON_WORDS",
    "OFFLINE_CORPUS",
    "TWIN_VARIANTS",
    "TwinEncoderConfig",
    "TwinEncoderForMaskedLM",
    "TwinSwapCollator",
    "TwinTable",
    "build_twins",
    "lm_collator",
    "load_corpus",
    "load_tokenizer",
    "offline_sentences",
    "paper_mlm_model",
    "small_gpt2",
    "tokenize_corpus",
]
