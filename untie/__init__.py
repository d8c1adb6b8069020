"""untie: train with tied input/output embeddings, then untie them (Bertolotti & Cazzola, ICML 2024)."""

from untie.callback import UntieCallback
from untie.checkpoint import checkpoint_is_untied, install_resume_guard, prepare_for_resume
from untie.config import UntieConfig
from untie.pairs import tokenizer_pairs
from untie.saved_state import UntieStateError
from untie.surgery import (
    EmbeddingLayout,
    embedding_layout,
    is_tied,
    tie_embeddings,
    untie_embeddings,
    was_untied,
)
from untie.triggers import RULES, UntieWhen
from untie.untier import Untier

__all__ = [
    "RULES",
    "EmbeddingLayout",
    "UntieCallback",
    "UntieConfig",
    "UntieStateError",
    "UntieWhen",
    "Untier",
    "checkpoint_is_untied",
    "embedding_layout",
    "install_resume_guard",
    "is_tied",
    "prepare_for_resume",
    "tie_embeddings",
    "tokenizer_pairs",
    "untie_embeddings",
    "was_untied",
]
__version__ = "0.1.0"
