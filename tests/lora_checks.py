"""PEFT LoRA models under TP, SP and FSDP2 (inside gloo workers), against a single-process PEFT model."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, parallelize
from lightning_automodel.io.hf_export import export_merged, export_peft_adapter
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.testing.harness import shared_directory
from lightning_automodel.testing.models import batch, tiny_model
from lightning_automodel.testing.parity import (
    FP32_TOLERANCE,
    LR,
    check_training,
    dims_for,
    forward_backward_errors,
    full,
    loss_of,
    relative_error,
    within_bf16_noise,
)
from lightning_automodel.testing.trainer_parity import (
    CausalLM,
    HFLossCausalLM,
    compare_training,
    data,
    hf_loss,
    reference_run,
    trainer,
)

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def peft_model(
    family: str = "llama",
    seed: int = 0,
    targets: tuple[str, ...] = LLAMA_TARGETS,
    adapter_seed: int | None = None,
    config: dict | None = None,
    **lora: object,
) -> torch.nn.Module:
    """A tiny model with LoRA adapters; both adapter matrices random (PEFT's default zero B would give A no
    gradient at the first step, and hide a wrong one). ``adapter_seed`` (default: ``seed``) seeds the adapters;
    ``config``: overrides of the family's tiny config."""
    model = tiny_model(family, seed=seed, **(config or {}))
    torch.manual_seed(seed if adapter_seed is None else adapter_seed)
    options = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False) | lora
    return get_peft_model(model, LoraConfig(target_modules=list(targets), **options))


def fit_lora_against_one_process(
    strategy: AutoModelParallelStrategy, *, dp: int, layers: int, validate: bool = False, callbacks: list = ()
) -> tuple[HFLossCausalLM, dict]:
    """A PEFT model (LoRA on every projection; the base frozen) trained through the Trainer (its own loss, 3 AdamW
    steps; with ``validate``, a validation batch after each): the adapters' gradients at each step and their weights
    after match one process's."""
    config = dict(num_hidden_layers=layers)
    module = HFLossCausalLM(peft_model(seed=dist.get_rank(), config=config))
    fit = trainer(strategy, limit_val_batches=1 if validate else 0, callbacks=list(callbacks))
    fit.fit(module, data(dp), data(dp) if validate else None)
    reference = peft_model(config=config)
    return module, compare_training(module, reference, reference_run(reference, loss=hf_loss))


def counts(model: torch.nn.Module) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "frozen": sum(p.numel() for p in params if not p.requires_grad),
    }


def check_lora_training(
    tp: int,
    sp: bool,
    activation_checkpointing: bool | str = False,
    family: str = "llama",
    ep: int = 1,
    **lora: object,
) -> dict:
    """Loss, logits, every adapter gradient at each of 3 AdamW steps, then the adapter weights; the trainable and
    frozen parameter counts are those of the single-process model."""
    targets = PHI3_TARGETS if family.startswith("phi3") else lora.pop("targets", LLAMA_TARGETS)
    mesh = dims_for(dist.get_world_size(), tp, ep=ep).build_mesh("cpu")
    reference = peft_model(family, targets=targets, **lora)
    model = peft_model(family, seed=dist.get_rank(), targets=targets, **lora)  # rank 0's adapters must win
    expected = counts(model)
    parallelize(model, mesh, sp=sp, activation_checkpointing=activation_checkpointing)
    assert counts(model) == expected, (counts(model), expected)
    result = check_training(model, reference, data_mesh(mesh))
    return {**result, **expected}


def check_lora_bf16_base(tp: int) -> dict:
    """A bf16 frozen base with fp32 adapters: FSDP units are cut by dtype, and the run is as close to fp32 as a
    single-process run of the same mixed model."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")

    def mixed() -> torch.nn.Module:
        model = peft_model()
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
        return model

    model = mixed()
    parallelize(model, mesh)
    adapter = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    assert adapter._get_fsdp_state()._fsdp_param_group is not None and adapter.weight.dtype == torch.float32
    errors = forward_backward_errors(model, peft_model(), data_mesh(mesh))
    noise = forward_backward_errors(mixed(), peft_model(), None)
    return within_bf16_noise(errors, noise)


def check_lora_adds_no_forward_collective() -> dict[str, int]:
    """At tp=2 with sp, a LoRA model's forward issues exactly the collectives of the same model without LoRA, and
    each adapter is split or replicated as described (a replicated row-parallel A would also compute right and
    add no collective, but hold tp times the memory)."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    found = {}
    for name, model in (("plain", tiny_model()), ("lora", peft_model())):
        parallelize(model, mesh, sp=True)
        tokens, labels = batch(2)
        with loss_parallel():
            with CommDebugMode() as forward:
                loss, _ = loss_of(model, tokens, labels)
            with CommDebugMode() as backward:
                loss.backward()
        found[f"{name}_forward"] = forward.get_total_counts()
        found[f"{name}_backward"] = backward.get_total_counts()
    assert found["lora_forward"] == found["plain_forward"], found
    attention = model.base_model.model.model.layers[0].self_attn  # the scheme README describes, on the tp dim
    for projection, a, b in (("q_proj", Replicate(), Shard(0)), ("o_proj", Shard(1), Replicate())):
        layer = getattr(attention, projection)
        for adapter, expected in ((layer.lora_A["default"], a), (layer.lora_B["default"], b)):
            weight = adapter.weight
            placement = weight.placements[weight.device_mesh.mesh_dim_names.index("tp")]
            assert placement == expected, (projection, placement, expected)
    return found


class LoraCausalLM(CausalLM):
    """Hands the optimizer the trainable parameters only, as LoRA users do: they must still be the adapters."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)


def check_lora_trainer(tp: int, sp: bool, activation_checkpointing: bool | str) -> dict:
    """Trainer.fit on a PEFT model: the strategy finds the Hugging Face model inside it; 3 AdamW steps in parity."""
    module = LoraCausalLM(peft_model(seed=dist.get_rank()))
    strategy = AutoModelParallelStrategy(tp=tp, sp=sp, activation_checkpointing=activation_checkpointing)
    fit = trainer(strategy)
    fit.fit(module, data(dist.get_world_size() // tp))
    optimized = {id(p) for group in fit.optimizers[0].param_groups for p in group["params"]}
    adapters = {id(p) for name, p in module.model.named_parameters() if "lora_" in name}
    assert optimized == adapters, "the optimizer must hold exactly the adapters"
    reference = peft_model()
    adam = lambda m: [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)]  # noqa: E731
    return compare_training(module, reference, reference_run(reference, optimizers=adam))


def check_peft_exports(tp: int, sp: bool, **lora: object) -> dict:
    """After an AdamW step, the adapter export loads into the base model with PeftModel.from_pretrained, and the
    merged export with AutoModelForCausalLM.from_pretrained, each giving the parallel model's logits; a failing
    export raises on every rank and leaves the previous export as it was."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    model = peft_model(seed=dist.get_rank(), **lora)
    parallelize(model, mesh, sp=sp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    tokens, labels = batch(4)
    with loss_parallel():
        loss_of(model, tokens, labels)[0].backward()
    optimizer.step()
    with torch.no_grad():
        logits = full(model(tokens).logits)
    directory = shared_directory()
    export_peft_adapter(model, directory / "adapter")
    export_merged(model, directory / "merged")
    result = {}
    if dist.get_rank() == 0:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {
            p.name for p in (directory / "adapter").iterdir()
        }
        adapter = PeftModel.from_pretrained(tiny_model(), directory / "adapter")
        merged = AutoModelForCausalLM.from_pretrained(directory / "merged")
        assert not any("lora_" in name or "base_layer" in name for name in merged.state_dict())
        with torch.no_grad():
            result["adapter_logits"] = relative_error(adapter(tokens).logits, logits)
            result["merged_logits"] = relative_error(merged(tokens).logits, logits)
        assert max(result.values()) < FP32_TOLERANCE, result
    result["failed_export"] = _check_failed_export_keeps_previous(model, directory / "adapter")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    return result


def _check_failed_export_keeps_previous(model: torch.nn.Module, directory: Path) -> str:
    before = {p.name: p.read_bytes() for p in directory.iterdir()} if dist.get_rank() == 0 else None
    save = model.save_pretrained

    def failing_save(*args, **kwargs):
        save(*args, **kwargs)  # part of the files are written, then the disk fills up
        raise OSError("No space left on device")

    model.save_pretrained = failing_save
    try:
        export_peft_adapter(model, directory)
    except (OSError, RuntimeError) as error:
        message = str(error)
    else:
        raise AssertionError("a failing export did not raise")
    finally:
        del model.save_pretrained
    if dist.get_rank() == 0:
        after = {p.name: p.read_bytes() for p in directory.iterdir()}
        assert after == before, "a failed export changed the previous one"
        leftovers = [p.name for p in directory.parent.iterdir() if p.name.startswith(".")]
        assert not leftovers, leftovers
    return message


def check_lora_resume(tp: int) -> dict:
    """Trainable-only checkpoints: 2 steps, a checkpoint holding the adapters alone, then 2 more steps resumed
    into a model with other adapters give the losses and weights of 4 uninterrupted steps."""
    directory = shared_directory()

    def fit(module: CausalLM, steps: int, ckpt_path: Path | None = None) -> L.Trainer:
        run = trainer(AutoModelParallelStrategy(tp=tp, save_trainable_only=True), max_steps=steps)
        run.fit(module, data(dist.get_world_size() // tp), ckpt_path=ckpt_path)
        return run

    whole = LoraCausalLM(peft_model())
    fit(whole, 4)
    interrupted = LoraCausalLM(peft_model())
    checkpoint = directory / "step-2.ckpt"
    fit(interrupted, 2).save_checkpoint(checkpoint)
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("state_dict.")]
    adapters = [name for name, p in interrupted.named_parameters() if p.requires_grad]
    assert sorted(weights) == sorted(f"state_dict.{name}" for name in adapters), weights
    resumed = LoraCausalLM(peft_model(adapter_seed=1))  # other adapters: the checkpoint's must replace them
    fit(resumed, 4, ckpt_path=checkpoint)
    finals = dict(whole.model.named_parameters())
    result = {
        "saved_tensors": len(weights),
        "model_tensors": len(list(whole.model.parameters())),
        "resumed_losses": max(abs(a - b) / b for a, b in zip(resumed.losses, whole.losses[2:], strict=True)),
        "resumed_weights": max(
            (full(p) - full(finals[n])).abs().max().item() for n, p in resumed.model.named_parameters()
        ),
    }
    assert len(resumed.losses) == 2 and result["resumed_losses"] < FP32_TOLERANCE, result
    assert result["resumed_weights"] < 1e-6, result
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    return result
