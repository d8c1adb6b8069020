"""Write what `untie.PUBLIC_API` (the one declaration of the public API) implies: `untie.__all__` and the
type-checking imports in untie/__init__.py, and docs/api.md (the API reference, one entry per public name).

    python scripts/public_api.py --write    # after changing PUBLIC_API
    python scripts/public_api.py --check    # what tests/test_layout.py runs: fails if either file is stale
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import untie

ROOT = Path(__file__).resolve().parent.parent
INIT = ROOT / "untie" / "__init__.py"
API_PAGE = ROOT / "docs" / "api.md"
BEGIN = "# fmt: off\n"
END = "# fmt: on\n"


def init_block() -> str:
    """`__all__` and the type-checking imports, sorted as ruff sorts them."""
    names = sorted(untie._EXPORTS, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))
    lines = ["__all__ = ["] + [f'    "{name}",' for name in names] + ["]", ""]
    lines.append("if TYPE_CHECKING:  # for type checkers and the API reference: the same names, imported eagerly")
    by_module: dict[str, list[str]] = {}
    for _section, module, found in untie.PUBLIC_API:
        by_module.setdefault(module, []).extend(found)
    for module in sorted(by_module):
        lines += [f"    from {module} import {name} as {name}" for name in by_module[module]]
    return "\n".join(lines) + "\n"


def api_page() -> str:
    sections: dict[str, list[tuple[str, str]]] = {}
    for section, module, names in untie.PUBLIC_API:
        sections.setdefault(section, []).extend((module, name) for name in names)
    parts = [
        "# API reference\n",
        "Generated from the docstrings, one entry per public name: every name here is importable from `untie` itself "
        "(`from untie import UntieCallback`), and nothing else is public. The page is written from `untie.PUBLIC_API` "
        "by `python scripts/public_api.py --write`; the architecture behind it is in [Development](development.md).\n",
    ]
    for section, entries in sections.items():
        parts.append(f"## {section}\n")
        parts += [f"::: {module}.{name}\n" for module, name in entries]
    return "\n".join(parts)


def rendered_init() -> str:
    """untie/__init__.py with the generated block, as `ruff check --fix` and `ruff format` leave it."""
    text = INIT.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=INIT.parent, delete=False) as file:
        file.write(text[:start] + init_block() + text[end:])
    try:
        for command in (["check", "--fix", "--quiet", "--exit-zero"], ["format", "--quiet"]):
            subprocess.run([sys.executable, "-m", "ruff", *command, file.name], check=True, cwd=ROOT)
        return Path(file.name).read_text()
    finally:
        os.unlink(file.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    wanted = {INIT: rendered_init(), API_PAGE: api_page()}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.write:
        for path in stale:
            path.write_text(wanted[path])
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    for path in stale:
        print(f"{path.relative_to(ROOT)} is stale: run python scripts/public_api.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    assert re.match(r"\d", untie.__version__)
    sys.exit(main())
