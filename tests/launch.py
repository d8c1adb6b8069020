"""One launcher for the tests' multi-process workers: `torchrun --nproc_per_node 2` on CPU (gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

#: The collected tests by node id (filled by conftest.py), so that a launch can read the markers of the test it runs in.
COLLECTED: dict = {}


def require_distributed_marker() -> None:
    """Fail a test that launches processes without the `distributed` marker: `pytest -m "not distributed"` (the quick
    set, docs/development.md) must leave out every test that starts a multi-process launch. The test is the one whose
    setup or call is running now (pytest's PYTEST_CURRENT_TEST), so a module fixture that launches is caught too."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    item = COLLECTED.get(current)
    if item is not None and item.get_closest_marker("distributed") is None:
        raise AssertionError(f"{current} launches processes: mark it @pytest.mark.distributed (or its module).")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment of a worker process: one thread each (2 ranks on 2 cores) and this interpreter's import path."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))


def torchrun(
    worker: str | os.PathLike, *args: object, processes: int = 2, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `worker` (a script in tests/, or a path) under torchrun with `args`; fail the test with its output if it
    fails.

    The launcher is `python -m torch.distributed.run` of the interpreter running the suite, so a venv works whether
    or not it is activated (the `torchrun` script need not be on PATH), and nothing here skips.

    Each process gets one thread (2 ranks on 2 cores); `env` adds variables. The timeout is a hang guard (a deadlocked
    worker), not a speed limit.
    """
    require_distributed_marker()
    script = os.path.join(os.path.dirname(__file__), worker)  # an absolute path stays as it is
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    cmd += ["--master_port", str(free_port()), script, *map(str, args)]
    result = subprocess.run(cmd, env={**worker_env(), **(env or {})}, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result
