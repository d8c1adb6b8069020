"""The quick set (`pytest -m "not recipes and not distributed"`, docs/development.md) leaves out every launch:
tests/launch.py refuses to start processes from a test without the `distributed` marker."""

from __future__ import annotations

import conftest
import pytest
from launch import require_distributed_marker, torchrun


def test_an_unmarked_test_that_launches_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(AssertionError, match="mark it @pytest.mark.distributed"):
        torchrun(tmp_path / "never_run.py")


@pytest.mark.distributed
def test_a_marked_test_may_launch():
    require_distributed_marker()  # no error: the marker is read from the running test


def test_a_test_that_takes_a_trainer_fixture_is_marked_trainer_and_a_unit_test_is_not(request, make_args):
    """The unit set (`-m "not slow and not recipes and not distributed and not trainer"`) leaves out every Trainer run:
    tests/conftest.py marks a test that takes one of `TRAINER_FIXTURES`."""
    assert request.node.get_closest_marker("trainer") is not None
    assert "make_args" in conftest.TRAINER_FIXTURES


def test_a_unit_test_is_not_marked_trainer(request):
    assert request.node.get_closest_marker("trainer") is None


def test_a_unit_test_is_in_the_quick_set_and_a_trainer_run_is_not(request, make_args):
    """`-m quick` (docs/development.md): tests/conftest.py marks `quick` every test none of `NOT_QUICK` marks."""
    assert request.node.get_closest_marker("trainer") is not None
    assert request.node.get_closest_marker("quick") is None


def test_a_plain_unit_test_is_quick(request):
    assert request.node.get_closest_marker("quick") is not None
    assert set(conftest.NOT_QUICK) == {"slow", "recipes", "distributed", "trainer", "process", "compile"}


def test_a_test_that_starts_a_process_is_marked_process_and_not_quick(request):
    """A test whose own code starts a Python process (`subprocess`, `sys.executable`) is marked `process`."""
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
    assert request.node.get_closest_marker("process") is not None
    assert request.node.get_closest_marker("quick") is None
