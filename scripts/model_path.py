"""Follow the model through `untie.Untier(model, max_steps=...)`: every call into a library function that receives the
model object itself as an argument, in order, and how often the path returns to a module it had already left.

    python scripts/model_path.py            # the summary line, then one line per call (module, function)

A measure of how scattered the attach phase is: the model's facts should be read in one place (`model_facts`), not
looked up again by every module on the way. It counts direct arguments only (not the model's submodules, config or
parameters), so other ways of following the model give other numbers.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import untie
from untie.testing import tiny_model


def follow() -> list[tuple[str, str]]:
    """(module path relative to untie/, function name) of each library call that receives the model."""
    model = tiny_model("gpt2")
    root = os.path.dirname(untie.__file__)
    stops: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(root):
            return
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(frame.f_locals.get(name) is model for name in arguments):
            stops.append((os.path.relpath(code.co_filename, root), code.co_name))

    sys.setprofile(profile)
    try:
        untie.Untier(model, max_steps=100, untie_when=None)
    finally:
        sys.setprofile(None)
    return stops


def main() -> None:
    stops = follow()
    left: set[str] = set()
    returns, previous = 0, None
    for module, _function in stops:
        if module != previous:
            returns += module in left
            if previous is not None:
                left.add(previous)
        previous = module
    modules = Counter(module for module, _ in stops)
    print(f"{len(stops)} calls into {len(modules)} modules, {returns} of them back into a module it had left")
    for module, function in stops:
        print(f"  {module}: {function}")


if __name__ == "__main__":
    main()
