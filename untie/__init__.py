"""untie: train with tied input/output embeddings, then untie them (Bertolotti & Cazzola, ICML 2024).

The public names load on first use (PEP 562), so that `import untie` and the `untie` command line start without
torch or transformers: `untie --help` and usage errors answer at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Public name -> the module that defines it.
_EXPORTS = {
    "UntieCallback": "untie.callback",
    "checkpoint_is_untied": "untie.checkpoint",
    "install_resume_guard": "untie.checkpoint",
    "prepare_for_resume": "untie.checkpoint",
    "UntieConfig": "untie.config",
    "tokenizer_pairs": "untie.pairs",
    "UntieStateError": "untie.saved_state",
    "EmbeddingLayout": "untie.surgery",
    "embedding_layout": "untie.surgery",
    "is_tied": "untie.surgery",
    "tie_embeddings": "untie.surgery",
    "untie_embeddings": "untie.surgery",
    "was_untied": "untie.surgery",
    "RULES": "untie.triggers",
    "UntieWhen": "untie.triggers",
    "Untier": "untie.untier",
}
__all__ = [  # the keys of _EXPORTS (a test checks it)
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

if TYPE_CHECKING:  # for type checkers and the API reference: the same names, imported eagerly
    from untie.callback import UntieCallback
    from untie.checkpoint import checkpoint_is_untied, install_resume_guard, prepare_for_resume
    from untie.config import UntieConfig
    from untie.pairs import tokenizer_pairs
    from untie.saved_state import UntieStateError
    from untie.surgery import EmbeddingLayout, embedding_layout, is_tied, tie_embeddings, untie_embeddings, was_untied
    from untie.triggers import RULES, UntieWhen
    from untie.untier import Untier


def __getattr__(name: str):
    """Import a public name's module on first use; `untie.<submodule>` imports that submodule."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'untie' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'untie' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
