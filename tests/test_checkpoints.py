"""Sharded Lightning checkpoints: exact resume, a save failing midway, resume into other layouts, conversion."""

from functools import partial

import pytest
from checkpoint_checks import (
    FAMILIES,
    assert_converted,
    check_data_position_restored,
    check_resume_into_layout,
    check_save_and_exact_resume,
    check_save_unsharded_resume_sharded,
)
from harness import run_checks


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_exactly_and_into_other_layouts(tmp_path, family):
    """Saved at tp=2 x dp_shard=2 (world 4), resumed there exactly, then at dp_shard=2 and at tp=2 (world 2);
    saved at dp_shard=2 and resumed at tp=2; converted to a Hugging Face directory by the command-line converter."""
    save = partial(check_save_and_exact_resume, str(tmp_path), 2, family)
    losses = run_checks(4, [save])[f"check_save_and_exact_resume({str(tmp_path)!r}, 2, {family!r})"][0]
    checks = [partial(check_resume_into_layout, str(tmp_path), tp, family, losses) for tp in (1, 2)]
    checks.append(partial(check_save_unsharded_resume_sharded, str(tmp_path), family, losses))
    run_checks(2, checks)
    assert_converted(tmp_path, family)


def test_data_position_restored_mid_epoch(tmp_path):
    """Resumed mid-epoch at tp=2 x dp_shard=2: a stateful loader continues at the next batch."""
    run_checks(4, [partial(check_data_position_restored, str(tmp_path), 2)])
