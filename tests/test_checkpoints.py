"""Sharded Lightning checkpoints: exact resume, a save failing midway, resume into other layouts, conversion."""

import io
import os
import random
import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_checks import (
    FAMILIES,
    assert_converted,
    check_asynchronous_saves_resume_exactly,
    check_data_position_restored,
    check_resume_into_layout,
    check_resume_with_dropout_exactly,
    check_save_and_exact_resume,
    check_save_unsharded_resume_sharded,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import ModelCheckpoint
from resume_checks import check_other_configuration_refused_or_loaded_in_part, check_resume_from_one_device
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_automodel.io.atomic_directory import atomic_directory, readable_path, unowned_entries
from lightning_automodel.io.checkpoint_contents import Held, folded_blocks
from lightning_automodel.io.full_checkpoint import FullCheckpoint
from lightning_automodel.io.lightning_checkpoint import load_checkpoint
from lightning_automodel.io.random_states import gather_random_states, restore_random_states
from lightning_automodel.testing.harness import run_checks


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.sweep) if f == "phi3" else f for f in FAMILIES])
def test_resume_exactly_and_into_other_layouts(tmp_path, family):
    """Saved at tp=2 x dp_shard=2 (world 4), resumed there exactly, then at dp_shard=2 and at tp=2 (world 2);
    saved at dp_shard=2 and resumed at tp=2; converted to a Hugging Face directory by the command-line converter.
    Lightning's single file from single-device training resumed at tp=2 x dp_shard=2 as the single-device run
    continues."""
    save = partial(check_save_and_exact_resume, str(tmp_path), 2, family)
    one_device = partial(check_resume_from_one_device, str(tmp_path), 2, family)
    losses = run_checks(4, [save, one_device])[f"check_save_and_exact_resume({str(tmp_path)!r}, 2, {family!r})"][0]
    checks = [partial(check_resume_into_layout, str(tmp_path), tp, family, losses) for tp in (1, 2)]
    checks.append(partial(check_save_unsharded_resume_sharded, str(tmp_path), family, losses))
    run_checks(2, checks)
    assert_converted(tmp_path, family)


def test_data_position_random_states_asynchronous_saves_and_other_configurations(tmp_path):
    """At tp=2 x dp_shard=2: resumed mid-epoch, a stateful loader continues at the next batch; with attention
    dropout, mid-epoch and at an epoch's end, the resumed run draws the uninterrupted run's masks; checkpoints saved
    asynchronously resume exactly; a checkpoint of another number of layers (sharded, or one device's file) is
    refused, or loaded in part when asked."""
    checks = [partial(check_data_position_restored, str(tmp_path), 2)]
    checks.append(partial(check_resume_with_dropout_exactly, str(tmp_path), 2))
    checks.append(partial(check_asynchronous_saves_resume_exactly, str(tmp_path), 2))
    checks.append(partial(check_other_configuration_refused_or_loaded_in_part, str(tmp_path), 2))
    for name, results in run_checks(4, checks).items():
        print(name, results[0])


def test_random_states_load_with_weights_only_and_restore_every_generator():
    """Python's, NumPy's and torch's generators come back as saved, from a file ``torch.load(weights_only=True)``
    reads (Lightning's ``fit(weights_only=True)``)."""
    saved = io.BytesIO()
    torch.save({"random_states": gather_random_states()}, saved)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    saved.seek(0)
    restore_random_states(torch.load(saved, weights_only=True)["random_states"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


class Killed(BaseException):
    """The job dies here: nothing after it runs (not even ``finally`` blocks that catch ``Exception``)."""


@pytest.mark.parametrize("renames_before_the_kill", [0, 1, 2, 3])
def test_the_newest_complete_save_is_found_at_every_moment_of_a_swap(tmp_path, monkeypatch, renames_before_the_kill):
    """The second save of last.ckpt is killed after each of the renames of its swap (and of the clean-up): the path
    (as ``readable_path`` reads it) and Lightning's ``ckpt_path="last"`` (the newest ``last*.ckpt``) find the
    second save once it is complete, the first before; the next save finishes what the killed one began and
    leaves last.ckpt alone."""
    target = tmp_path / "last.ckpt"

    def save(version: int) -> None:
        with atomic_directory(target, unowned=lambda path: []) as staging:
            (staging / "version").write_text(str(version))
            os.utime(staging, (0, 0))  # whatever time the file server's clock gave it: the swap makes it the newest

    save(1)
    rename, renames = Path.rename, []

    def rename_then_maybe_die(self, destination):
        if len(renames) == renames_before_the_kill:
            raise Killed
        renames.append(destination)
        return rename(self, destination)

    monkeypatch.setattr(Path, "rename", rename_then_maybe_die)
    with pytest.raises(Killed):
        save(2)
    monkeypatch.setattr(Path, "rename", rename)
    expected = "1" if renames_before_the_kill == 0 else "2"  # complete once named last.new.ckpt
    assert (readable_path(target) / "version").read_text() == expected
    candidates = ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer=None)
    newest = max(candidates, key=lambda path: Path(path).stat().st_mtime)  # as Lightning resolves "last"
    assert (Path(newest) / "version").read_text() == expected, sorted(candidates)
    save(3)
    assert [path.name for path in tmp_path.iterdir()] == ["last.ckpt"]
    assert (target / "version").read_text() == "3"


def test_a_users_folder_beside_the_path_is_refused_not_deleted(tmp_path):
    """A swap puts the previous copy aside as ``<name>.old``: a folder of that name holding a user's files makes the
    save refuse (FileExistsError, before anything is written), and the folder is left as it was."""
    target = tmp_path / "model"
    with atomic_directory(target, unowned=_only_weights) as staging:
        (staging / "weights").write_text("1")
    (tmp_path / "model.old").mkdir()
    (tmp_path / "model.old" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        with atomic_directory(target, unowned=_only_weights) as staging:
            (staging / "weights").write_text("2")
    assert (tmp_path / "model.old" / "notes.txt").read_text() == "mine"
    assert (target / "weights").read_text() == "1"


def _only_weights(path: Path) -> list[str]:
    return unowned_entries(path, owned=lambda entry: entry.name == "weights")


def test_optimizer_settings_load_by_group_position(tmp_path):
    """A checkpoint holds the param groups' parameter names as one rank saved them; under pp another rank holds other
    parameters (here: "b" and "c" where "a" and "b" were saved), and a group may hold none. Each group takes the saved
    settings of the group at its position, and its parameters the state the checkpoint holds for them."""
    saving = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    groups = [{"params": saving["a"].parameters(), "lr": 0.1}, {"params": [], "lr": 0.2}]
    optimizer = torch.optim.AdamW([*groups, {"params": saving["b"].parameters(), "lr": 0.3}], betas=(0.5, 0.6))
    (saving["a"](torch.ones(1, 2)) + saving["b"](torch.ones(1, 2))).sum().backward()
    optimizer.step()
    state = {"state_dict": get_model_state_dict(saving), "optimizer_0": get_optimizer_state_dict(saving, optimizer)}
    dcp.save(state, checkpoint_id=tmp_path)
    torch.save({}, tmp_path / _METADATA_FILENAME)
    stage = torch.nn.ModuleDict({"b": torch.nn.Linear(2, 2), "c": torch.nn.Linear(2, 2)})
    groups = [{"params": stage["c"].parameters()}, {"params": []}, {"params": stage["b"].parameters()}]
    resumed = torch.optim.AdamW(groups, lr=1.0)
    load_checkpoint(tmp_path, stage, [resumed], strict=False)
    assert [group["lr"] for group in resumed.param_groups] == [0.1, 0.2, 0.3]
    assert all(group["betas"] == (0.5, 0.6) for group in resumed.param_groups)
    saved_moments = optimizer.state[saving["b"].weight]["exp_avg"]
    assert torch.equal(resumed.state[stage["b"].weight]["exp_avg"], saved_moments)
    resumed.step()  # every group has what AdamW reads


def test_optimizer_state_numbered_by_position_is_placed_on_the_stages_parameters(tmp_path):
    """A single-device file numbers AdamW's state through its param groups (here vectors first, then matrices).
    Two pipeline stages each hold a share of both groups: the whole groups are the shares in the model's order, and
    each parameter gets its own state. Shares out of the model's order, or groups of other sizes, cannot be placed:
    the reason is given (the load refuses, or, when partial, leaves the state fresh)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
    vectors, matrices = [m.bias for m in model], [m.weight for m in model]
    optimizer = torch.optim.AdamW([{"params": vectors}, {"params": matrices}])
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    path = tmp_path / "one-device.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, path)
    first, second = Held({}, [[["0.bias"], ["0.weight"]]]), Held({}, [[["1.bias", "2.bias"], ["1.weight", "2.weight"]]])
    reader = FullCheckpoint(path, weights_only=True)
    stored = reader.contents([first, second])
    assert not stored.unplaced and stored.sizes["optimizer_0.state.2.weight.exp_avg"] == (5, 4)
    for name, param in model.named_parameters():
        assert torch.equal(stored.states[0][name]["exp_avg"], optimizer.state[param]["exp_avg"]), name

    def unplaced(*held: Held) -> str:
        return FullCheckpoint(path, weights_only=True).contents(list(held)).unplaced[0]

    assert "order other than the model's" in unplaced(
        first, Held({}, [[["2.bias", "1.bias"], ["1.weight", "2.weight"]]])
    )
    assert "holds 3 parameters where this run's holds 2" in unplaced(
        Held({}, [[["0.bias", "1.bias"], ["0.weight", "1.weight"]]])
    )


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
@pytest.mark.parametrize("weights_only", [False, True], ids=["one optimizer saved", "weights only"])
def test_an_optimizer_the_checkpoint_holds_no_state_of_starts_fresh_or_is_refused(tmp_path, sharded, weights_only):
    """A run of two optimizers resumed from a checkpoint of a run of one, or of the weights alone (save_weights_only):
    with strict loading refused, naming each optimizer the checkpoint holds no state of; without, the weights and the
    state it holds are loaded, and each such optimizer starts fresh (zero moments), warned."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))
    saving = torch.optim.AdamW(model[0].parameters())
    model(torch.ones(1, 2)).sum().backward()
    saving.step()
    path = _saved(tmp_path, model, [] if weights_only else [saving], sharded=sharded)
    missing = [0, 1] if weights_only else [1]

    def resumed(*, strict: bool) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        built = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))
        optimizers = [torch.optim.AdamW(built[0].parameters()), torch.optim.AdamW(built[1].parameters())]
        load_checkpoint(path, built, optimizers, strict=strict)
        return built, optimizers

    with pytest.raises(ValueError, match="strict_loading is on") as error:
        resumed(strict=True)
    for index in missing:
        assert f"optimizer_{index}: the checkpoint holds no state of it" in str(error.value), str(error.value)
    with pytest.warns(UserWarning, match="starts fresh: the checkpoint holds no state of it") as warned:
        built, optimizers = resumed(strict=False)
    fresh_ones = [re.search(r"optimizer (\d+)'s state is not loaded and starts fresh", str(w.message)) for w in warned]
    assert [int(found.group(1)) for found in fresh_ones if found] == missing
    assert all(torch.equal(value, built.state_dict()[name]) for name, value in model.state_dict().items())
    moments = [[state["exp_avg"] for state in optimizer.state.values()] for optimizer in optimizers]
    assert [not any(torch.count_nonzero(moment) for moment in each) for each in moments] == [0 in missing, True]
    if not weights_only:
        for loaded, saved in zip(built[0].parameters(), model[0].parameters(), strict=True):
            assert torch.equal(optimizers[0].state[loaded]["exp_avg"], saving.state[saved]["exp_avg"])


def _saved(directory: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], *, sharded: bool) -> Path:
    """``model`` and ``optimizers`` saved as Lightning saves them: one file (by position), or sharded (by name)."""
    if not sharded:
        path = directory / "one-device.ckpt"
        states = {"optimizer_states": [optimizer.state_dict() for optimizer in optimizers]} if optimizers else {}
        torch.save({"state_dict": model.state_dict(), **states}, path)
        return path
    state = {"state_dict": get_model_state_dict(model)}
    state.update({f"optimizer_{i}": get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)})
    dcp.save(state, checkpoint_id=directory)
    torch.save({}, directory / _METADATA_FILENAME)
    return directory


def test_a_packed_weights_blocks_fold_and_a_module_named_blocks_stays():
    """Qwen2-VL's tower keeps its layers in ``blocks``: once taken for a packed weight's blocks and dropped, which
    made every checkpoint of it refused on resume as lacking the tower."""
    sizes = {
        "state_dict.visual.blocks.0.attn.qkv.weight": (6, 2),
        "state_dict.layers.0.qkv_proj.weight.block0": (4, 2),
        "state_dict.layers.0.qkv_proj.weight.block1": (2, 2),
    }
    assert folded_blocks(sizes) == {
        "state_dict.visual.blocks.0.attn.qkv.weight": (6, 2),
        "state_dict.layers.0.qkv_proj.weight": 12,
    }
