"""The keys of per-pair metrics in logs, histories and results (``"gap/0-1"``): built and read here only.

Torch-free, so that the trigger policies and the CLI's argument parsing can read keys without importing torch.
"""

from __future__ import annotations


def pair_key(pair: tuple[int, int]) -> str:
    """The name a pair gets in logs and results: ``"0-1"``."""
    return f"{pair[0]}-{pair[1]}"


def metric_key(name: str, pair: tuple[int, int] | str) -> str:
    """A per-pair metric's key, ``"gap/0-1"``: the one place such keys are built (`split_metric_key` reads them)."""
    return f"{name}/{pair if isinstance(pair, str) else pair_key(pair)}"


def split_metric_key(key: str) -> tuple[str, str]:
    """``("gap", "0-1")`` for a per-pair key ``"gap/0-1"``; ``(key, "")`` for any other (``"cosine"``, ``"gap"``,
    ``"gap/max"``)."""
    name, _, pair = key.rpartition("/")
    return (name, pair) if name and pair.replace("-", "").isdigit() and "-" in pair else (key, "")
