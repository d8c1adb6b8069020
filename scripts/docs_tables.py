"""Regenerate, or check, the results tables of the docs from the commands that write them.

Every generated table sits in its page between two markers, with its command written next to it:

    <!-- table: exor-quick -->
    | variant | model | arm | ... |
    <!-- end table: exor-quick -->

and its name is an entry of `TABLES` below: the command, the file it writes, and how the table is read from that
file. A table is never edited by hand; a change that alters what it reports regenerates it here:

    python scripts/docs_tables.py --write exor-quick      # run the command, replace the table in its page
    python scripts/docs_tables.py --check --cheap         # what CI runs: the cheap tables must equal their command's
    python scripts/docs_tables.py --list                  # every table, its page, command and cost

Only tables whose numbers are deterministic (same seed, same numbers on any machine and worker count) are checked;
timings are measurements, dated by the commit and machine written next to them. The expensive tables (tens of
minutes or more on 2 cores) are not run by CI: each page names the commit its table was made on.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def first_table(text: str) -> str:
    """The first Markdown table of a file: its consecutive lines that start with `|`."""
    lines, started = [], False
    for line in text.splitlines():
        if line.startswith("|"):
            lines.append(line)
            started = True
        elif started:
            break
    if not lines:
        raise ValueError("the command's output holds no Markdown table")
    return "\n".join(lines)


def without_columns(*names: str) -> Callable[[str], str]:
    """`first_table` without the named columns (timings: measurements, not results a seed fixes)."""

    def extract(text: str) -> str:
        lines = first_table(text).splitlines()
        rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
        keep = [i for i, name in enumerate(rows[0]) if name not in names]
        kept = ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
        kept[1] = "|" + "---|" * len(keep)  # the header separator
        return "\n".join(kept)

    return extract


@dataclass(frozen=True)
class Table:
    """A table of the docs and the command that writes it."""

    page: str
    """The page, relative to the repository root."""
    command: tuple[str, ...]
    """The command, run from the repository root; `{out}` is a fresh folder."""
    output: str
    """The file the command writes the table into, relative to `{out}`."""
    extract: Callable[[str], str] = first_table
    cheap: bool = False
    """Cheap enough for CI (minutes on 2 cores)."""

    def shell(self) -> str:
        return " ".join(self.command).replace(" --output_dir {out}", "").replace(" --disable_tqdm", "")


TABLES: dict[str, Table] = {
    "exor-quick": Table(
        page="docs/recipes/exor.md",
        command=(
            "python",
            "recipes/exor.py",
            "--arms",
            "untied",
            "tied",
            "scheduled",
            "scheduled-reset",
            "auto",
            "--output_dir",
            "{out}",
            "--disable_tqdm",
        ),  # fmt: skip
        output="results.md",
        cheap=True,
    ),
    "bookcorpus-quick": Table(
        page="docs/recipes/bookcorpus.md",
        command=("python", "recipes/bookcorpus.py", "--output_dir", "{out}", "--disable_tqdm"),
        output="results.md",
        extract=without_columns("tokens/s", "vs tied"),
    ),
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- table: {name} -->", f"<!-- end table: {name} -->"


def committed(name: str) -> str:
    """The table as its page holds it now."""
    table = TABLES[name]
    text = (ROOT / table.page).read_text()
    start, end = _markers(name)
    match = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), text, flags=re.S)
    if match is None:
        raise SystemExit(f"{table.page} has no '{start}' ... '{end}' block for the table {name}.")
    return match.group(1)


def generate(name: str) -> str:
    """Run the table's command in a fresh folder and return the table it writes."""
    table = TABLES[name]
    with tempfile.TemporaryDirectory(prefix=f"docs-table-{name}-") as out:
        command = [sys.executable if part == "python" else part.replace("{out}", out) for part in table.command]
        print(f"[{name}] {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return table.extract(Path(out, table.output).read_text()).strip()


def write(name: str, new: str) -> None:
    table = TABLES[name]
    path = ROOT / table.page
    start, end = _markers(name)
    text = path.read_text()
    committed(name)  # the markers must be there
    text = re.sub(re.escape(start) + r"\n.*?\n" + re.escape(end), lambda _: f"{start}\n{new}\n{end}", text, flags=re.S)
    path.write_text(text)
    print(f"[{name}] written into {table.page}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="run the commands and replace the tables in their pages")
    mode.add_argument("--check", action="store_true", help="run the commands; exit 1 if a page's table differs")
    mode.add_argument("--list", action="store_true", help="list the tables, their pages, commands and cost")
    parser.add_argument("--cheap", action="store_true", help="only the tables cheap enough for CI")
    parser.add_argument("names", nargs="*", help=f"tables to process (default: all): {', '.join(TABLES)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(TABLES))
    if unknown:
        parser.error(f"unknown table(s) {unknown}; choose among {sorted(TABLES)}")
    names = [n for n in (args.names or TABLES) if TABLES[n].cheap or not args.cheap]
    if args.list:
        for name in names:
            table = TABLES[name]
            print(f"{name}: {table.page}  ({'cheap: CI checks it' if table.cheap else 'expensive'})\n  {table.shell()}")
        return 0
    stale = []
    for name in names:
        new = generate(name)
        if args.write:
            write(name, new)
        elif new != committed(name).strip():
            stale.append(name)
            print(f"[{name}] {TABLES[name].page} differs from what its command writes now:\n{new}", file=sys.stderr)
        else:
            print(f"[{name}] {TABLES[name].page}: up to date")
    if stale:
        print(
            f"Stale tables: {', '.join(stale)}. Regenerate them in this change: python scripts/docs_tables.py --write "
            + " ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
