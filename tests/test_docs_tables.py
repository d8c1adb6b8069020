"""`scripts/docs_tables.py`: a page's generated table is replaced by, or checked against, what its command writes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def docs_tables(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "docs_tables", module)
    spec.loader.exec_module(module)
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n<!-- table: toy -->\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- end table: toy -->\n\nAfter.\n"
    )
    table = "title\\n\\n| a | b |\\n|---|---|\\n| 1 | VALUE |\\n\\nx"  # text, a table, more text
    writer = f"import sys; open(sys.argv[1] + '/out.md', 'w').write('{table}')"
    command = ("python", "-c", writer.replace("VALUE", "2"), "{out}")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "TABLES", {"toy": module.Table(page="page.md", command=command, output="out.md")})
    return module, page, writer


def test_check_passes_when_the_page_holds_what_the_command_writes(docs_tables):
    module, _, _ = docs_tables
    assert module.main(["--check"]) == 0


def test_check_fails_naming_the_stale_table_and_write_replaces_only_it(docs_tables, capsys):
    module, page, writer = docs_tables
    module.TABLES["toy"] = module.Table(page="page.md", command=("python", "-c", writer.replace("VALUE", "3"), "{out}"),
                                        output="out.md")  # fmt: skip
    assert module.main(["--check"]) == 1
    assert "Stale tables: toy" in capsys.readouterr().err
    assert module.main(["--write"]) == 0
    assert page.read_text() == (
        "Intro.\n\n<!-- table: toy -->\n| a | b |\n|---|---|\n| 1 | 3 |\n<!-- end table: toy -->\n\nAfter.\n"
    )
    assert module.main(["--check"]) == 0


def test_every_registered_table_has_its_markers_and_its_command_next_to_it():
    spec = importlib.util.spec_from_file_location("docs_tables_real", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_tables_real"] = module
    spec.loader.exec_module(module)
    for name, table in module.TABLES.items():
        assert module.committed(name).startswith("|"), name
        assert table.shell() in (ROOT / table.page).read_text(), (name, table.shell())
