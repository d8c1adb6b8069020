"""The fine-tuning's shifted domain (issue 68, item 2; docs/recipes/study.md, "Fine-tuning"): a fourth source outside
cell A's pretraining mix.

Cell A pretrains on all three of the decision map's sources, so none of them is left to shift to. The target is the
fortune files of Debian's `fortunes` package (bookworm, main): quotations, jokes, verse and definitions, far from
manuals, scripture and plays. Every file under ``usr/share/games/fortunes`` is read except the ``.dat`` indexes, the
``.u8`` links and ``ascii-art`` (pictures, not text); each fortune (the text between two ``%`` lines) is one document;
every `TARGET_VALIDATION_EVERY`-th document is held out. The text is cut into blocks with the pretraining corpus's
tokenizer, unchanged: a loaded model keeps its vocabulary.

The package is fetched once (`apt-get download`, no root), unpacked (`dpkg-deb -x`) and its documents cached with its
file's name and SHA-256, like the decision map's Debian manuals; it is used locally and never committed."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

from untie_recipes.tasks.decision_map.corpus import CorpusUnavailable, TokenizedCorpus, cut_blocks, written_whole

#: The Debian package that holds the target's text, and where in it.
TARGET_PACKAGE = "fortunes"
TARGET_FOLDER = "usr/share/games/fortunes"
#: Files of that folder that are not prose.
EXCLUDED_FILES = frozenset({"ascii-art"})
#: Every 10th fortune is held out (a fortune is short: a larger share than the pretraining corpus's 1 in 50 keeps
#: the target's validation split near 60,000 tokens).
TARGET_VALIDATION_EVERY = 10
TARGET_SOURCE = "fortunes"


def fortunes_in(folder: Path) -> list[str]:
    """The fortunes of an unpacked `fortunes` folder, file by file (sorted by name), each stripped of trailing space."""
    documents = []
    for path in sorted(folder.iterdir()):
        if path.is_symlink() or not path.is_file() or path.suffix in (".dat", ".u8") or path.name in EXCLUDED_FILES:
            continue
        fortune: list[str] = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.strip() == "%":
                if fortune:
                    documents.append("\n".join(fortune))
                fortune = []
            elif line.strip() or fortune:
                fortune.append(line.rstrip())
        if fortune:
            documents.append("\n".join(fortune))
    return documents


def fetch_target_documents(cache_dir: Path) -> tuple[list[str], dict]:
    """The target's documents and the package they came from ({"package", "sha256", "documents"}): from the cache, or
    fetched and unpacked once."""
    cached = cache_dir / "corpora" / f"{TARGET_SOURCE}.jsonl.gz"
    facts_path = cached.parent / f"{TARGET_SOURCE}.json"
    if cached.exists() and facts_path.exists():
        with gzip.open(cached, "rt", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle], json.loads(facts_path.read_text())
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(["apt-get", "download", TARGET_PACKAGE], cwd=folder, capture_output=True, text=True)
        debs = sorted(Path(folder).glob(f"{TARGET_PACKAGE}_*.deb"))
        if done.returncode != 0 or not debs:
            raise CorpusUnavailable(
                f"could not fetch {TARGET_PACKAGE} (apt-get download {TARGET_PACKAGE}): {done.stderr.strip()[-400:]}. "
                "The fine-tuning's target needs Debian's archive once; --finetune false leaves the fine-tuning out."
            )
        unpacked = Path(folder) / "unpacked"
        unpacked.mkdir()
        done = subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], capture_output=True, text=True)
        if done.returncode != 0:
            raise CorpusUnavailable(f"could not unpack {debs[0].name} (dpkg-deb -x): {done.stderr.strip()[-400:]}")
        documents = fortunes_in(unpacked / TARGET_FOLDER)
        facts = {"package": debs[0].name, "sha256": hashlib.sha256(debs[0].read_bytes()).hexdigest(),
                 "documents": len(documents)}  # fmt: skip
    cached.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(cached) as partial, gzip.open(partial, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(doc) + "\n" for doc in documents)
    facts_path.write_text(json.dumps(facts, indent=2) + "\n")
    return documents, facts


def target_corpus(documents: list[str], tokenizer) -> TokenizedCorpus:
    """The target's training and validation blocks (every `TARGET_VALIDATION_EVERY`-th document held out), cut with
    the pretraining corpus's `tokenizer`."""
    every = TARGET_VALIDATION_EVERY
    train = [d for i, d in enumerate(documents) if i % every != every - 1]
    validation = [d for i, d in enumerate(documents) if i % every == every - 1]
    return TokenizedCorpus(cut_blocks(tokenizer, train), cut_blocks(tokenizer, validation), tokenizer,
                           (TARGET_SOURCE,))  # fmt: skip
