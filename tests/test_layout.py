"""The codebase's own rules: private upstream names live in `untie/_compat.py` only, the package is typed, and the
library stands apart from the paper reproductions (`untie_recipes`, mapped from recipes/)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import untie
import untie_recipes

PACKAGE = Path(untie.__file__).parent
#: Private names of transformers / accelerate / torch that only `untie._compat` may touch.
PRIVATE_UPSTREAM = re.compile(
    r"_getframe|_shared_state|_execution_engine|_model_mapping|\b_from_config|\ball_tied_weights"
)


def test_upstream_internals_are_touched_in_the_compat_module_only():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_UPSTREAM.search(line)
    ]
    assert not offenders, "move these into untie/_compat.py:\n" + "\n".join(offenders)


def test_the_package_is_marked_typed():
    assert (PACKAGE / "py.typed").is_file()


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_library_never_imports_the_recipes_or_their_plotting():
    offenders = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in {"untie_recipes", "matplotlib"}
    }
    assert not offenders, "the library must not depend on the recipes' side:\n" + "\n".join(sorted(offenders))


def test_importing_the_library_loads_neither_recipes_nor_matplotlib():
    code = (
        "import sys, untie, untie.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'untie_recipes', 'matplotlib'}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded


def test_the_recipes_package_is_the_recipes_folder_and_ships_its_corpus():
    from untie_recipes.tasks.bookcorpus.data import OFFLINE_CORPUS, OFFLINE_VOCAB

    assert Path(untie_recipes.__file__).parent == PACKAGE.parent / "recipes"
    assert not (PACKAGE / "exor").exists() and not (PACKAGE / "bookcorpus").exists()
    assert OFFLINE_CORPUS.is_file() and OFFLINE_VOCAB.is_file()
