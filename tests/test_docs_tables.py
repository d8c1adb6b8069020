"""`scripts/docs_tables.py`: a page's generated table is replaced by, or checked against, what its command writes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

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
    monkeypatch.setattr(module, "TABLES", {"toy": module.Table(page="page.md", commands=(command,), output="out.md")})
    return module, page, writer


def test_check_passes_when_the_page_holds_what_the_command_writes(docs_tables):
    module, _, _ = docs_tables
    assert module.main(["--check"]) == 0


def test_check_fails_naming_the_stale_table_and_write_replaces_only_it(docs_tables, capsys):
    module, page, writer = docs_tables
    command = ("python", "-c", writer.replace("VALUE", "3"), "{out}")
    module.TABLES["toy"] = module.Table(page="page.md", commands=(command,), output="out.md")
    assert module.main(["--check"]) == 1
    assert "Stale tables: toy" in capsys.readouterr().err
    assert module.main(["--write"]) == 0
    assert page.read_text() == (
        "Intro.\n\n<!-- table: toy -->\n| a | b |\n|---|---|\n| 1 | 3 |\n<!-- end table: toy -->\n\nAfter.\n"
    )
    assert module.main(["--check"]) == 0


@pytest.fixture(scope="module")
def real_tables():
    spec = importlib.util.spec_from_file_location("docs_tables_real", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_tables_real"] = module
    spec.loader.exec_module(module)
    return module


def test_every_registered_table_has_its_markers_and_its_commands_next_to_it(real_tables):
    for name, table in real_tables.TABLES.items():
        assert real_tables.committed(name).startswith("|"), name
        for line in table.shell():
            assert line in (ROOT / table.page).read_text(), (name, line)


#: Tables of the docs that report no results: settings, codes, behaviours, presets (compared by their header row).
REFERENCE_TABLES = {
    "| code | meaning |",
    "| script | what it does |",
    "| case | behaviour |",
    "| setting | default | meaning |",
    "| signal | definition | reads |",
    "| name | rule | use |",
    "| preset | data | tokenizer | twins | model init | batch | optimizer and schedule | length |",
    "| preset | variants | models | arms | seeds | steps | optimizer and schedule |",
    "| source | what | where it comes from | size |",
    "| adapter | module | its loop's events |",
}


def _tables(text: str) -> list[tuple[int, str]]:
    """(line index, header row) of every Markdown table in a page."""
    lines = text.splitlines()
    return [
        (i, line.strip())
        for i, line in enumerate(lines)
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
    ]


def test_every_results_table_is_registered_with_its_commands_and_its_commit(real_tables):
    data = ROOT / "docs" / "data"  # run records and the reports commands wrote (mkdocs' exclude_docs): not pages
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if data not in p.parents)]
    unregistered = []
    for page in pages:
        lines = page.read_text().splitlines()
        for i, header in _tables(page.read_text()):
            registered = i > 0 and lines[i - 1].startswith("<!-- table: ")
            if not registered and header not in REFERENCE_TABLES:
                unregistered.append(f"{page.relative_to(ROOT)}:{i + 1} {header}")
    assert not unregistered, f"results tables without a command in scripts/docs_tables.py: {unregistered}"
    for name, table in real_tables.TABLES.items():
        if table.cost in ("cheap", "data"):  # checked by CI against what its command writes now
            continue
        text = (ROOT / table.page).read_text()
        start = text.index(f"<!-- table: {name} -->")
        end = text.index(f"<!-- end table: {name} -->")
        around = text[max(0, start - 1500) : end + 600]
        commits = re.findall(r"commit ([0-9a-f]{7,40})\b", around)
        assert commits, f"{table.page}: the {table.cost} table {name} names no commit it was made on"
        if table.cost == "cpu-kind":
            assert "exact on the CPU kind" in around, f"{table.page}: {name} does not say which CPU kind it is exact on"


def test_ci_checks_the_quick_starts_tables_and_every_verdict_is_one_of_three(real_tables):
    """CI compares which claims the quick start checks (the kernel-path record in tests/test_kernel_paths.py shows it
    the same on every path tried and on both CPU kinds recorded; the preset's numbers and verdicts are exact on one
    CPU kind) and the study's summary (read from its committed records: nothing is trained, cost "data"); no
    verdict but yes / no / not tested."""
    cheap = {name for name, table in real_tables.TABLES.items() if table.cost == "cheap"}
    assert cheap == {"exor-quick-checked"}
    ci = (ROOT / ".ci" / "run").read_text()
    assert "docs_tables.py --check --cheap --from runs/exor exor-quick-checked" in ci
    data = {name for name, table in real_tables.TABLES.items() if table.cost == "data"}
    assert data == {
        "when-it-pays",
        "when-it-pays-verdict",
        "when-it-pays-round-two",
        "when-it-pays-cross-kind",
        "when-it-pays-share",
        "when-it-pays-loaded",
        "library-share-bands",
        "when-it-pays-trigger",
    }
    one_line = ci.replace(" \\\n  ", " ")
    ordered = " ".join(sorted(data, key=lambda name: (len(name), name)))
    assert f"docs_tables.py --check {ordered}" in one_line  # CI checks every data table
    claims = real_tables.committed("exor-quick-claims")
    assert claims.splitlines()[0] == "| claim | holds | evidence |"
    verdicts = {line.split(" | ")[1].strip() for line in claims.splitlines()[2:]}
    assert verdicts <= {"yes", "**no**", "not tested"}, verdicts
    checked = real_tables.committed("exor-quick-checked").splitlines()
    assert checked[0] == "| claim | checked |" and len(checked) == len(claims.splitlines())
    assert [row.split(" | ")[0] for row in checked[2:]] == [row.split(" | ")[0] for row in claims.splitlines()[2:]]


def test_the_checked_table_reads_a_verdict_as_checked_and_not_tested_as_not(docs_tables):
    module = docs_tables[0]
    results = (
        "| a |\n|---|\n| 1 |\n\n| claim | holds | evidence |\n|---|---|---|\n| one | yes | e |\n"
        "| two | **no** | e |\n| three | not tested | e |\n"
    )
    assert module.claims_checked(results).splitlines() == [
        "| claim | checked |",
        "|---|---|",
        "| one | yes |",
        "| two | yes |",
        "| three | no |",
    ]


def test_the_generated_table_of_several_commands_reads_the_last_ones_standard_output(docs_tables):
    module, page, writer = docs_tables
    first = ("python", "-c", "import sys, pathlib; pathlib.Path(sys.argv[1], 'n').write_text('2')", "{out}")
    second = ("python", "-c", "import sys, pathlib; print('| a | b |\\n|---|---|\\n| 1 |', pathlib.Path("
              "sys.argv[1], 'n').read_text(), '|')", "{out}")  # fmt: skip
    module.TABLES["toy"] = module.Table(page="page.md", commands=(first, second), output=None)
    assert module.main(["--check"]) == 0


def test_tables_read_from_one_report_run_its_commands_once(docs_tables, tmp_path):
    """The decision map's report holds three tables, each registered apart: one check runs the map once."""
    module, page, _ = docs_tables
    counter = tmp_path / "runs.txt"
    report = "| a | b |\\n|---|---|\\n| 1 | 2 |\\n\\nbetween\\n\\n| c |\\n|---|\\n| 3 |\\n"
    command = ("python", "-c", f"import sys; open({str(counter)!r}, 'a').write('run\\n'); "
               f"open(sys.argv[1] + '/out.md', 'w').write('{report}')", "{out}")  # fmt: skip
    page.write_text(page.read_text() + "\n<!-- table: second -->\n| c |\n|---|\n| 3 |\n<!-- end table: second -->\n")
    module.TABLES.update({
        name: module.Table(page="page.md", commands=(command,), output="out.md", extract=module.nth_table(index))
        for index, name in enumerate(("toy", "second"))
    })  # fmt: skip
    assert module.main(["--check"]) == 0
    assert counter.read_text() == "run\n"
    with pytest.raises(ValueError, match="holds 2 Markdown table"):
        module.nth_table(2)(report.replace("\\n", "\n"))


def test_from_reads_the_report_of_a_run_that_already_ended(docs_tables, tmp_path):
    """An expensive table run in sittings (the decision map) is written from its finished output folder."""
    module, page, _ = docs_tables
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "out.md").write_text("| a | b |\n|---|---|\n| 1 | 7 |\n")
    assert module.main(["--check", "toy", "--from", str(finished)]) == 1
    assert module.main(["--write", "toy", "--from", str(finished)]) == 0
    assert "| 1 | 7 |" in page.read_text()
    with pytest.raises(SystemExit):
        module.main(["--check", "--from", str(finished)])  # no table named
