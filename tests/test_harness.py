import time

import pytest
from harness_checks import check_every_rank_hangs, check_rank_one_hangs, check_rank_one_raises

from lightning_automodel.testing.harness import ChecksFailed, run_checks


def test_a_rank_stuck_in_a_collective_fails_after_the_process_group_timeout():
    start = time.monotonic()
    with pytest.raises(ChecksFailed, match=r"rank 0, check check_rank_one_hangs\(\)") as error:
        run_checks(2, [check_rank_one_hangs], pg_timeout=5)
    assert "Timed out" in str(error.value)
    assert time.monotonic() - start < 60


def test_a_hang_outside_collectives_fails_at_the_launch_timeout():
    start = time.monotonic()
    with pytest.raises(ChecksFailed, match="timed out after 5s"):
        run_checks(2, [check_every_rank_hangs], timeout=5)
    assert time.monotonic() - start < 30


def test_a_failure_names_its_rank_and_check():
    with pytest.raises(ChecksFailed, match=r"rank 1, check check_rank_one_raises\(\)") as error:
        run_checks(2, [check_rank_one_raises], pg_timeout=5)
    assert "deliberate failure" in str(error.value)
