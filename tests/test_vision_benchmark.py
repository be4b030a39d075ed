"""benchmarks/vision.py follows the strategy, the vision data module and the demo's config: its measuring code (each
variant's Trainer, the counting of records and real tokens, the table) runs here in one process on a few steps, so
that a change of their interfaces fails here rather than when someone next measures."""

import pytest
import torch

from benchmarks import vision


def test_real_tokens_leave_out_padding_of_padded_and_packed_rows():
    padded = {"input_ids": torch.zeros(2, 6), "attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6])}
    assert vision.real_tokens(padded, pad_id=9) == 9
    packed = {
        "input_ids": torch.tensor([[5, 5, 5, 5, 9, 9], [5, 5, 5, 5, 5, 9]]),
        "position_ids": torch.tensor([[0, 1, 0, 1, 0, 1], [0, 1, 2, 0, 1, 2]]),  # the second ends on a record
    }
    assert vision.real_tokens(packed, pad_id=9) == 4 + 6


def test_each_variant_trains_and_is_counted_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = vision.parse_args(["--steps", "3", "--warmup", "1", "--seq-len", "160", "--batch-size", "2"])
    files = vision.prepare(tmp_path / "lightning-automodel", args, world=1)
    fits = {variant: vision.fit(variant, files, args, world=1) for variant in ("peer", "ours", "ours_packed")}
    for variant, fitted in fits.items():
        assert len(fitted["seconds"]) == 2 and min(fitted["seconds"]) > 0, variant  # the steps after the warm-up
    assert fits["ours"]["records"] == fits["peer"]["records"] == 2 * 2  # the timed steps' rows, a record each
    assert fits["ours_packed"]["records"] > fits["ours"]["records"]  # two records a row fit in 160 tokens
    assert 2 * 2 * 60 < fits["ours"]["tokens"] < 2 * 2 * 80  # the records' own tokens, not the 160 of a row
    rows = vision.table([[fits]], ["peer", "ours", "ours_packed"])
    assert rows[2].startswith("| peer |") and rows[4].startswith("| ours_packed |")
    with pytest.raises(KeyError):
        vision.fit("nobody", files, args, world=1)
