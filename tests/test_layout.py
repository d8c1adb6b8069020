"""The codebase's own rules: private upstream names live in `untie/_compat.py` only, and the package is typed."""

from __future__ import annotations

import re
from pathlib import Path

import untie

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
