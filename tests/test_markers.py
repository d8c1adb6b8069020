"""The quick set (`pytest -m "not recipes and not distributed"`, docs/development.md) leaves out every launch:
tests/launch.py refuses to start processes from a test without the `distributed` marker."""

from __future__ import annotations

import pytest
from launch import require_distributed_marker, torchrun


def test_an_unmarked_test_that_launches_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(AssertionError, match="mark it @pytest.mark.distributed"):
        torchrun(tmp_path / "never_run.py")


@pytest.mark.distributed
def test_a_marked_test_may_launch():
    require_distributed_marker()  # no error: the marker is read from the running test
