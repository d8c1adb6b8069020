"""EXor, the paper's synthetic task: its data generator and small models, importable by recipes and tests."""

from untie_recipes.tasks.exor.data import (
    EQUIVALENT_PAIRS,
    PAIRS,
    VARIANTS,
    ExorDataset,
    ExorVocabulary,
    exor_splits,
    vocabulary,
)
from untie_recipes.tasks.exor.modeling import PAPER_MODELS, ExorConfig, ExorForMaskedLM, exor_model

__all__ = [
    "EQUIVALENT_PAIRS",
    "PAIRS",
    "PAPER_MODELS",
    "VARIANTS",
    "ExorConfig",
    "ExorDataset",
    "ExorForMaskedLM",
    "ExorVocabulary",
    "exor_model",
    "exor_splits",
    "vocabulary",
]
