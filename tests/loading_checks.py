"""Pretrained checkpoints loaded into parallelized models (inside gloo workers), against transformers'
own single-process from_pretrained of the same directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from lightning_automodel import AutoModelParallelStrategy, export_hf, from_pretrained, parallelize
from lightning_automodel.hf import shrink
from lightning_automodel.hf.loading import materialize_pretrained
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.testing.harness import shared_directory
from lightning_automodel.testing.models import batch, tiny_model, tiny_tokenizer
from lightning_automodel.testing.parity import FP32_TOLERANCE, dims_for, forward_backward_errors, full, relative_error
from lightning_automodel.testing.trainer_parity import CausalLM, compare_training, data, reference_run, trainer


def saved_checkpoint(family: str, shard_size: str | None = None, **config: object) -> Path:
    """A checkpoint written by save_pretrained (of a model no rank builds by itself: seed 3; ``config``: overrides)."""
    directory = shared_directory()
    if dist.get_rank() == 0:
        options = {"max_shard_size": shard_size} if shard_size else {}
        _built(family, **config).save_pretrained(directory, **options)
    dist.barrier()
    return directory


def _built(family: str, **config: object) -> torch.nn.Module:
    """A family of testing/models.py, or any model type by the coverage report's tiny config (``type:bamba``)."""
    if not family.startswith("type:"):
        return tiny_model(family, seed=3, **config)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(shrink.tiny_config(family.removeprefix("type:")))


def remove(directory: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)


def check_loaded_weights(family: str, tp: int, sp: bool, shard_size: str | None = None, ep: int = 1) -> dict:
    """Every weight equals transformers' own load of the directory, and so do loss, logits and gradients."""
    directory = saved_checkpoint(family, shard_size)
    if shard_size:
        assert (directory / "model.safetensors.index.json").is_file(), "the checkpoint must be sharded"
    auto_class = AutoModelForSequenceClassification if family == "qwen3_cls" else AutoModelForCausalLM
    reference = auto_class.from_pretrained(directory, dtype=torch.float32)
    model = from_pretrained(directory, model_class=auto_class, dtype=torch.float32)
    mesh = dims_for(dist.get_world_size(), tp, ep=ep).build_mesh("cpu")
    parallelize(model, mesh, sp=sp)
    materialize_pretrained(model, torch.device("cpu"))
    reference_state = reference.state_dict()
    result = {"weights": max((full(t) - reference_state[n]).abs().max().item() for n, t in model.state_dict().items())}
    assert result["weights"] == 0.0, result
    if getattr(reference.get_output_embeddings(), "weight", None) is reference.get_input_embeddings().weight:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "lm_head came untied"
    result.update(forward_backward_errors(model, reference, data_mesh(mesh)))
    assert max(result.values()) < FP32_TOLERANCE, result
    remove(directory)
    return result


class PretrainedCausalLM(CausalLM):
    """What a user writes: from_pretrained in configure_model."""

    def __init__(self, directory: Path) -> None:
        super().__init__(model=torch.nn.Identity())
        self.directory = directory

    def configure_model(self) -> None:
        if isinstance(self.model, torch.nn.Identity):
            self.model = from_pretrained(self.directory, dtype=torch.float32)


def check_pretrained_trainer(family: str, tp: int) -> dict:
    """Trainer.fit from a pretrained directory: 3 AdamW steps in parity with transformers' own load."""
    directory = saved_checkpoint(family)
    module = PretrainedCausalLM(directory)
    trainer(AutoModelParallelStrategy(tp=tp)).fit(module, data(dist.get_world_size() // tp))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    result = compare_training(module, reference, reference_run(reference))
    remove(directory)
    return result


def check_loaded_dtypes() -> dict:
    """A bf16 checkpoint loads as bf16 with dtype="auto" and as fp32 when asked, equal to transformers' loads.
    Ernie-4.5-MoE's experts, stored one tensor per expert and projection (and its fp32 router), load equal to
    transformers' load. A model whose checkpoint transformers splits on load (Lara-Mini's one stored in_proj into
    in_proj_qkv and in_proj_z) is refused when built, with what to do instead."""
    directory = shared_directory()
    if dist.get_rank() == 0:
        tiny_model(seed=3).to(torch.bfloat16).save_pretrained(directory / "llama")
        tiny_model("ernie_moe", seed=3).save_pretrained(directory / "ernie")
        AutoModelForCausalLM.from_config(shrink.tiny_config("lara_mini")).save_pretrained(directory / "lara")
    dist.barrier()
    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    result = {}
    for dtype in ("auto", torch.float32):
        model = from_pretrained(directory / "llama", dtype=dtype)
        parallelize(model, mesh)
        materialize_pretrained(model, torch.device("cpu"))
        reference = AutoModelForCausalLM.from_pretrained(directory / "llama", dtype=dtype).state_dict()
        for key, tensor in model.state_dict().items():
            assert full(tensor).dtype == reference[key].dtype and torch.equal(full(tensor), reference[key]), key
        result[str(dtype)] = sorted({str(t.dtype) for t in model.state_dict().values()})
    assert result == {"auto": ["torch.bfloat16"], "torch.float32": ["torch.float32"]}, result
    ernie = from_pretrained(directory / "ernie")
    parallelize(ernie, mesh)
    materialize_pretrained(ernie, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(directory / "ernie").state_dict()
    result["ernie"] = max(
        (full(t).float() - reference[n].float()).abs().max().item() for n, t in ernie.state_dict().items()
    )
    assert result["ernie"] == 0.0, result
    with pytest.raises(ValueError, match="Split.*transformers' own from_pretrained") as error:
        from_pretrained(directory / "lara")  # one stored in_proj split into in_proj_qkv and in_proj_z
    result["lara"] = str(error.value)
    remove(directory)
    return result


def check_export_round_trip(family: str, tp: int, sp: bool, ep: int = 1) -> dict:
    """Load a checkpoint, take an AdamW step, export: from_pretrained of the export (sharded, with its index)
    gives the parallel model's logits, and the config and generation config come along."""
    directory = saved_checkpoint(family)
    mesh = dims_for(dist.get_world_size(), tp, ep=ep).build_mesh("cpu")
    model = from_pretrained(directory, dtype=torch.float32)
    parallelize(model, mesh, sp=sp)
    materialize_pretrained(model, torch.device("cpu"))
    forward_backward_errors(model, AutoModelForCausalLM.from_pretrained(directory), data_mesh(mesh))
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    tokens = batch(2)[0]
    with torch.no_grad():
        logits = full(model(tokens).logits)
    export_hf(model, directory / "export", tokenizer=tiny_tokenizer(), max_shard_size=40_000)
    result = {}
    if dist.get_rank() == 0:
        files = {p.name for p in (directory / "export").iterdir()}
        expected = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"}
        assert expected <= files, files
        assert AutoTokenizer.from_pretrained(directory / "export")("w5 w7")["input_ids"] == [5, 7]
        exported = AutoModelForCausalLM.from_pretrained(directory / "export")
        with torch.no_grad():
            result["logits"] = relative_error(exported(tokens).logits, logits)
        result["shards"] = sum(name.endswith(".safetensors") for name in files)
        assert result["logits"] < FP32_TOLERANCE and result["shards"] > 1, result
    remove(directory)
    return result


def check_pretrained_peft(tp: int, sp: bool) -> dict:
    """get_peft_model on a from_pretrained model built on meta: the base weights are the checkpoint's, the
    adapters initialised by PEFT's rule (B zero, so the model computes exactly the pretrained model); with
    init_lora_weights=False, drawn like any Linear (not left as uninitialised memory)."""
    from peft import LoraConfig, get_peft_model

    directory = saved_checkpoint("llama")
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    plain = get_peft_model(from_pretrained(directory), LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    parallelize(plain, dims_for(dist.get_world_size(), tp).build_mesh("cpu"))
    materialize_pretrained(plain.get_base_model(), torch.device("cpu"))
    for name, param in plain.named_parameters():  # PEFT leaves these to the Linears' own init: drawn, finite
        if "lora_" in name:
            assert torch.isfinite(full(param)).all() and full(param).abs().max() > 0, name
    model = get_peft_model(from_pretrained(directory, dtype=torch.float32), LoraConfig(r=4, target_modules=targets))
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    parallelize(model, mesh, sp=sp)
    materialize_pretrained(model.get_base_model(), torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    expected = reference.state_dict()
    result = {"base_weights": 0.0}
    for name, tensor in model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        difference = (full(tensor) - expected[name.replace(".base_layer.", ".")]).abs().max().item()
        result["base_weights"] = max(result["base_weights"], difference)
    adapters = {name: full(p) for name, p in model.named_parameters() if "lora_" in name}
    assert adapters and all(not t.any() for name, t in adapters.items() if "lora_B" in name), "B must start at zero"
    bound = 1 / 64**0.5  # kaiming_uniform(a=sqrt(5)) over fan_in = hidden size: PEFT's rule for A
    a_values = [t for name, t in adapters.items() if "lora_A" in name]
    assert all(0 < t.abs().max() <= bound and t.std() > bound / 4 for t in a_values), "A is not PEFT's init"
    tokens = batch(2)[0]
    with torch.no_grad():
        result["logits"] = relative_error(full(model(tokens).logits), reference(tokens).logits)
    assert result["base_weights"] == 0.0 and result["logits"] < FP32_TOLERANCE, result
    remove(directory)
    return result


def check_export_failure_on_rank0() -> dict:
    """A write failing on rank 0 only, halfway through the tensors, raises on every rank instead of leaving the
    others waiting in the next gather, and leaves no directory behind."""
    from lightning_automodel.io import hf_export as export

    directory = saved_checkpoint("llama")
    model = from_pretrained(directory, dtype=torch.float32)
    parallelize(model, dims_for(dist.get_world_size(), 2).build_mesh("cpu"))
    materialize_pretrained(model, torch.device("cpu"))
    add = export._ShardWriter.add
    calls = []

    def failing_add(self, name, tensor):
        calls.append(name)
        if len(calls) > 3:
            raise OSError("No space left on device")
        add(self, name, tensor)

    export._ShardWriter.add = failing_add
    try:
        with pytest.raises((OSError, RuntimeError)) as error:
            export_hf(model, directory / "export", max_shard_size=40_000)
    finally:
        export._ShardWriter.add = add
    assert not (directory / "export").exists()
    remove(directory)
    return {"error": str(error.value)}
