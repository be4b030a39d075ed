"""PEFT LoRA models under TP, SP and FSDP2 (inside gloo workers), against a single-process PEFT model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning_checks import CausalLM, compare_training, data, reference_run, trainer
from models import batch, tiny_model
from parity import (
    LR,
    check_training,
    dims_for,
    forward_backward_errors,
    loss_of,
    within_bf16_noise,
)
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel import AutoModelParallelStrategy, parallelize
from lightning_automodel.mesh import data_mesh

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def peft_model(
    family: str = "llama", seed: int = 0, targets: tuple[str, ...] = LLAMA_TARGETS, **lora: object
) -> torch.nn.Module:
    """A tiny model with LoRA adapters; both adapter matrices random (PEFT's default zero B would give A no
    gradient at the first step, and hide a wrong one)."""
    model = tiny_model(family, seed=seed)
    torch.manual_seed(seed)
    options = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False) | lora
    return get_peft_model(model, LoraConfig(target_modules=list(targets), **options))


def counts(model: torch.nn.Module) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "frozen": sum(p.numel() for p in params if not p.requires_grad),
    }


def check_lora_training(
    tp: int, sp: bool, activation_checkpointing: bool | str = False, family: str = "llama", **lora: object
) -> dict:
    """Loss, logits, every adapter gradient at each of 3 AdamW steps, then the adapter weights; the trainable and
    frozen parameter counts are those of the single-process model."""
    targets = PHI3_TARGETS if family.startswith("phi3") else lora.pop("targets", LLAMA_TARGETS)
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
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
    """At tp=2 with sp, a LoRA model's forward issues exactly the collectives of the same model without LoRA."""
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
