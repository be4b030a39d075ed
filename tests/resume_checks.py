"""Resuming from a checkpoint that is not quite this run's (inside gloo workers): Lightning's single file written by
single-device training, and checkpoints of another configuration, refused or loaded in part."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_checks import fit
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.distributed.tensor import DTensor

from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, TRAINED_LOSS_TOLERANCE, WEIGHT_TOLERANCE, full
from lightning_automodel.testing.trainer_parity import CausalLM, data, trainer

WEIGHT_DECAY = 0.1


def two_groups(parameters, lr: float) -> torch.optim.Optimizer:
    """AdamW in two param groups as CausalLMModule makes them (weight decay on matrices only), the vectors' group
    first: a single-device file, which numbers the optimizer's state through its groups, then numbers it in an
    order other than the model's."""
    parameters = list(parameters)
    vectors = {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0}
    matrices = {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": WEIGHT_DECAY}
    return torch.optim.AdamW([vectors, matrices], lr=lr)


def fit_on_one_device(module: CausalLM, steps: int, save: Path | None = None) -> Any:
    """Lightning's plain single-device run of ``module`` on rank 0 (the other ranks wait), as a user trains before
    their first sharded run; ``save``: its checkpoint, Lightning's single file. Returns rank 0's losses, weights and
    optimizer state by parameter name, on every rank."""
    result = None
    if dist.get_rank() == 0:
        run = trainer(SingleDeviceStrategy(torch.device("cpu")), devices=1, max_steps=steps)
        run.fit(module, data(1))
        if save is not None:
            run.save_checkpoint(save)
        names = {param: name for name, param in module.model.named_parameters()}
        moments = {names[param]: state for param, state in run.optimizers[0].state.items()}
        result = {"losses": module.losses, "weights": dict(module.model.named_parameters()), "moments": moments}
    shared = [result]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


class Resumed(CausalLM):
    """Records what the checkpoint's load left as training starts: every weight and optimizer state (whole), and
    whether each state tensor is sharded as its parameter."""

    def on_train_start(self) -> None:
        optimizer = self.trainer.optimizers[0]
        self.loaded_weights = {name: full(p).clone() for name, p in self.model.named_parameters()}
        self.loaded_moments, self.sharded_as_parameters = {}, True
        for name, param in self.model.named_parameters():
            state = optimizer.state.get(param, {})
            self.loaded_moments[name] = {key: full(value).clone() for key, value in state.items()}
            for key in ("exp_avg", "exp_avg_sq"):
                placed = isinstance(param, DTensor) and isinstance(state.get(key), DTensor)
                placed = placed and state[key].placements == param.placements
                self.sharded_as_parameters &= placed or not isinstance(param, DTensor)
        self.group_settings = [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups]


def check_resume_from_one_device(directory: str, tp: int, family: str = "llama") -> dict:
    """2 AdamW steps (two param groups) on one device, saved as Lightning's single file, resumed at tp (x dp_shard
    over the other ranks): as training starts, every weight and AdamW moment is the file's, each sharded as its
    parameter, and each group has its settings; the next 2 losses and the weights after them are those of the
    single-device run continued to 4 steps."""
    path = Path(directory) / "one-device.ckpt"
    saved = fit_on_one_device(CausalLM(tiny_model(family), optimizer=two_groups), 2, save=path)
    continued = fit_on_one_device(CausalLM(tiny_model(family), optimizer=two_groups), 4)
    resumed = Resumed(tiny_model(family, seed=5 + dist.get_rank()), optimizer=two_groups)
    fit(resumed, tp, 4, ckpt_path=path)
    assert resumed.sharded_as_parameters and resumed.group_settings == [(resumed.lr, 0.0), (resumed.lr, WEIGHT_DECAY)]
    result = {
        "loaded_weights": _largest_difference(resumed.loaded_weights, saved["weights"]),
        "loaded_moments": max(
            _largest_difference(resumed.loaded_moments[name], state) for name, state in saved["moments"].items()
        ),
        "first_loss": abs(resumed.losses[0] - continued["losses"][2]) / continued["losses"][2],
        "second_loss": abs(resumed.losses[1] - continued["losses"][3]) / continued["losses"][3],
        "weights": _largest_difference(dict(resumed.model.named_parameters()), continued["weights"]),
    }
    assert result["loaded_weights"] == 0.0 and result["loaded_moments"] == 0.0, result
    assert result["first_loss"] < FP32_TOLERANCE and result["second_loss"] < TRAINED_LOSS_TOLERANCE, result
    assert result["weights"] < WEIGHT_TOLERANCE, result
    return result


def check_other_configuration_refused_or_loaded_in_part(directory: str, tp: int) -> dict:
    """Checkpoints of the same model with 3 layers (sharded, and a single-device file) resumed into 2 layers, and
    one of 2 layers into 3: refused on every rank, the message naming what one side holds and the other lacks
    (weights and optimizer state) and the partial load; with ``strict_loading = False``, the weights both hold are
    the checkpoint's, the others as built, and so is the optimizer state of the parameters both hold (a single-device
    file, which numbers it by position over other groups, leaves it fresh, warned); training goes on. A single file
    cut short is refused on every rank, naming it."""
    root = Path(directory)
    saved = {}
    for layers in (2, 3):
        module = CausalLM(tiny_model(num_hidden_layers=layers))
        run = fit(module, tp, 1)
        run.save_checkpoint(root / f"layers-{layers}.ckpt")
        names = {param: name for name, param in module.model.named_parameters()}
        saved[root / f"layers-{layers}.ckpt"] = {
            "weights": {name: full(param).clone() for param, name in names.items()},
            "moments": {
                names[p]: {k: full(v).clone() for k, v in s.items()} for p, s in run.optimizers[0].state.items()
            },
        }
    one_file = root / "layers-3-one-device.ckpt"
    saved[one_file] = fit_on_one_device(CausalLM(tiny_model(num_hidden_layers=3)), 1, save=one_file) | {"moments": {}}
    extra = r"weights in the checkpoint that this model lacks: model\.model\.layers\.2\..* and 6 more"
    unused = r"optimizer_0: state in the checkpoint of parameters this run does not train: model\.model\.layers\.2\."
    lacking = r"weights of this model that the checkpoint lacks: model\.model\.layers\.2\."
    no_state = r"optimizer_0: the checkpoint lacks the state of parameters this run trains: model\.model\.layers\.2\."
    by_position = r"optimizer_0: the file keys its state by position, and its param group 0 holds 30 parameters where"
    weights_alone = r"To start a new run from its weights alone, load them into the LightningModule before fit"
    cases = {
        "3 into 2 layers": (root / "layers-3.ckpt", 2, [extra, unused]),
        "3 into 2 layers, one device's file": (one_file, 2, [extra, by_position, weights_alone]),
        "2 into 3 layers": (root / "layers-2.ckpt", 3, [lacking, no_state]),
    }
    result = {}
    for case, (path, layers, patterns) in cases.items():
        with pytest.raises(ValueError, match="strict_loading = False") as error:
            fit(CausalLM(tiny_model(num_hidden_layers=layers, seed=3)), tp, 2, ckpt_path=path)
        missed = [pattern for pattern in patterns if not re.search(pattern, str(error.value))]
        assert not missed, (missed, str(error.value))
        result[case] = str(error.value)
        result[f"{case}, partial"] = _check_partial_load(path, layers, tp, saved[path])
    damaged = root / "damaged.ckpt"
    if dist.get_rank() == 0:
        damaged.write_bytes(one_file.read_bytes()[: one_file.stat().st_size // 2])
    dist.barrier()
    with pytest.raises(ValueError, match=f"{damaged} cannot be read") as error:
        fit(CausalLM(tiny_model(num_hidden_layers=3, seed=3)), tp, 2, ckpt_path=damaged)
    result["damaged"] = str(error.value)
    return result


def _check_partial_load(path: Path, layers: int, tp: int, saved: dict[str, dict]) -> dict:
    """Resumed with ``strict_loading = False``: the weights both hold are the checkpoint's, the others as built; the
    optimizer state of the parameters both hold (``saved["moments"]``) is the checkpoint's."""
    built = {name: p.detach().clone() for name, p in tiny_model(num_hidden_layers=layers, seed=3).named_parameters()}
    resumed = Resumed(tiny_model(num_hidden_layers=layers, seed=3))
    resumed.strict_loading = False
    fit(resumed, tp, 2, ckpt_path=path)
    weights = saved["weights"]
    expected = {name: weights.get(name, built[name]) for name in resumed.loaded_weights}
    result = {"loaded": len(expected.keys() & weights.keys()), "kept": len(expected.keys() - weights.keys())}
    result["weights"] = _largest_difference(resumed.loaded_weights, expected)
    moments = {name: state for name, state in saved["moments"].items() if name in resumed.loaded_moments}
    result["moments"] = _largest_difference(resumed.loaded_moments, moments)
    assert result["weights"] == 0.0 and result["moments"] == 0.0 and result["loaded"] > 0, result
    assert len(resumed.losses) == 1, result
    return result


def _largest_difference(actual: dict[str, Any], expected: dict[str, Any]) -> float:
    """The largest difference of any tensor of ``expected`` (nested dicts of tensors) from ``actual``'s."""
    assert actual.keys() >= expected.keys(), expected.keys() - actual.keys()
    differences = [
        _largest_difference(actual[key], value)
        if isinstance(value, dict)
        else (full(actual[key]).float() - full(value).float()).abs().max().item()
        for key, value in expected.items()
    ]
    return max(differences, default=0.0)
