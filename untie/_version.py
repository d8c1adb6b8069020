"""The library's version, in a leaf module (it imports nothing): any module reads it without importing the public
API. `untie/__init__.py` re-exports it; pyproject.toml's `version` equals it (tests/test_layout.py)."""

__version__ = "0.1.0"
