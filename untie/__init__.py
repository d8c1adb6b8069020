"""untie: train with tied input/output embeddings, then untie them (Bertolotti & Cazzola, ICML 2024).

The public names load on first use (PEP 562), so that `import untie` and the `untie` command line start without
torch or transformers: `untie --help` and usage errors answer at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: The public API, declared once: (the section of docs/api.md, the module that defines them, the names). `__all__`,
#: the type-checking imports below and docs/api.md are generated from it: `python scripts/public_api.py --write`
#: (tests/test_layout.py runs `--check`).
PUBLIC_API = (
    ("Trainer", "untie.adapters.callback", ("UntieCallback",)),
    ("Settings", "untie.decision.settings", ("UntieConfig", "parse_command_line")),
    ("Custom training loops", "untie.adapters.untier", ("Untier",)),
    ("The divergence trigger", "untie.decision.triggers", ("UntieWhen", "RULES")),
    ("Pairs from the tokenizer", "untie.signals.pairs", ("tokenizer_pairs", "TokenPair")),
    (
        "Surgery",
        "untie.structure.surgery",
        ("untie_embeddings", "tie_embeddings", "is_tied", "was_untied", "embedding_layout", "EmbeddingLayout"),
    ),
    (
        "Checkpoints",
        "untie.checkpoints.checkpoint",
        ("checkpoint_is_untied", "prepare_for_resume", "install_resume_guard"),
    ),
    ("Errors", "untie.errors", ("UntieError",)),
    ("Errors", "untie.checkpoints.saved_state", ("UntieStateError",)),
    ("Errors", "untie.structure.peft_support", ("PeftUnsupported",)),
    ("Errors", "untie.core.phases", ("RunOrderError",)),
)
#: Public name -> the module that defines it (from `PUBLIC_API`).
_EXPORTS = {name: module for _section, module, names in PUBLIC_API for name in names}
from untie._version import __version__ as __version__  # noqa: E402  (a leaf module; re-exported)

# -- generated from PUBLIC_API by scripts/public_api.py: do not edit by hand ------------------------------------------
# fmt: off
__all__ = [
    "RULES",
    "EmbeddingLayout",
    "PeftUnsupported",
    "RunOrderError",
    "TokenPair",
    "UntieCallback",
    "UntieConfig",
    "UntieError",
    "UntieStateError",
    "UntieWhen",
    "Untier",
    "checkpoint_is_untied",
    "embedding_layout",
    "install_resume_guard",
    "is_tied",
    "parse_command_line",
    "prepare_for_resume",
    "tie_embeddings",
    "tokenizer_pairs",
    "untie_embeddings",
    "was_untied",
]

if TYPE_CHECKING:  # for type checkers and the API reference: the same names, imported eagerly
    from untie.adapters.callback import UntieCallback as UntieCallback
    from untie.adapters.untier import Untier as Untier
    from untie.checkpoints.checkpoint import checkpoint_is_untied as checkpoint_is_untied
    from untie.checkpoints.checkpoint import install_resume_guard as install_resume_guard
    from untie.checkpoints.checkpoint import prepare_for_resume as prepare_for_resume
    from untie.checkpoints.saved_state import UntieStateError as UntieStateError
    from untie.core.phases import RunOrderError as RunOrderError
    from untie.decision.settings import UntieConfig as UntieConfig
    from untie.decision.settings import parse_command_line as parse_command_line
    from untie.decision.triggers import RULES as RULES
    from untie.decision.triggers import UntieWhen as UntieWhen
    from untie.errors import UntieError as UntieError
    from untie.signals.pairs import TokenPair as TokenPair
    from untie.signals.pairs import tokenizer_pairs as tokenizer_pairs
    from untie.structure.peft_support import PeftUnsupported as PeftUnsupported
    from untie.structure.surgery import EmbeddingLayout as EmbeddingLayout
    from untie.structure.surgery import embedding_layout as embedding_layout
    from untie.structure.surgery import is_tied as is_tied
    from untie.structure.surgery import tie_embeddings as tie_embeddings
    from untie.structure.surgery import untie_embeddings as untie_embeddings
    from untie.structure.surgery import was_untied as was_untied
# fmt: on
# -- end of generated ------------------------------------------------------------------------------------------------


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
