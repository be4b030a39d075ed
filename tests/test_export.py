"""`lightning-automodel export` in one process: a tiny model's checkpoint written shard by shard is what
save_pretrained writes for the model loaded whole (files, index, names, tensors and dtypes), LoRA merged as PEFT merges
or written as an adapter PEFT loads, each shard read by key in bounded batches, and an interrupted export leaves
nothing. The layouts (tp, FSDP2, pp with virtual stages, ep, LoRA at tp) are checked where their checkpoints are saved:
tests/test_checkpoints.py, test_pipeline.py, test_expert_parallel.py, test_lm.py."""

from functools import partial
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from lightning_automodel.hf.peft import with_lora
from lightning_automodel.io.checkpoint_to_hf import export_checkpoint
from lightning_automodel.io.export import source, writing
from lightning_automodel.io.export.safetensors_file import SafetensorsFile
from lightning_automodel.testing.exports import assert_same_directory, save_pretrained_whole, write_lightning_checkpoint
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.vision.models import tiny_vision_model

SHARD = 20_000  # bytes: a tiny model in 10 to 30 files
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _checkpoint(tmp_path: Path, model: torch.nn.Module, **metadata) -> Path:
    """As CausalLMModule saves one: its config recorded, with the model's class."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict() | {"architectures": [type(base).__name__]}
    write_lightning_checkpoint(model, tmp_path / "ckpt", hf_config=config, **metadata)
    return tmp_path / "ckpt"


def _meta_like(model: torch.nn.Module) -> torch.nn.Module:
    with torch.device("meta"):
        return type(model)(model.config)


MODELS = {
    "llama": partial(tiny_model, "llama"),
    "qwen3_moe": partial(tiny_model, "qwen3_moe"),
    "gemma3_vlm": partial(tiny_model, "gemma3_vlm"),
    "phi3": partial(tiny_model, "phi3"),
    "llava": partial(tiny_vision_model, "llava"),
    "qwen3_vl_moe": partial(tiny_vision_model, "qwen3_vl_moe"),
}


@pytest.mark.parametrize("family", MODELS)
def test_export_writes_what_save_pretrained_writes(tmp_path, family):
    """Llama (tied embeddings), Qwen3-MoE (fused experts written per expert, views of one storage kept in one
    shard), Gemma 3 and LLaVA with their vision towers (renamed keys), Phi-3 (fused projections), Qwen3-VL-MoE
    (both); in bf16 with fp32 norms (every dtype kept): the same files, index, config and tensors as
    save_pretrained."""
    model = MODELS[family]().to(torch.bfloat16)
    for name, module in model.named_modules():
        if "norm" in name.rsplit(".", 1)[-1]:
            module.float()
    checkpoint = _checkpoint(tmp_path, model)
    export_checkpoint(checkpoint, tmp_path / "export", max_shard_size=SHARD)
    save_pretrained_whole(checkpoint, _meta_like(model), tmp_path / "peer", max_shard_size=SHARD)
    result = assert_same_directory(tmp_path / "export", tmp_path / "peer")
    assert result["files"] > 5, result  # several shards and their index
    export_checkpoint(checkpoint, tmp_path / "one-file")  # save_pretrained's default: one file
    save_pretrained_whole(checkpoint, _meta_like(model), tmp_path / "peer-one-file")
    assert assert_same_directory(tmp_path / "one-file", tmp_path / "peer-one-file")["files"] == 1


def _lora_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    peft = with_lora(tiny_model("llama"), LORA)
    torch.manual_seed(3)
    for name, param in peft.named_parameters():
        if "lora_B" in name:  # trained adapters: a merge that does nothing would pass otherwise
            param.data.normal_(std=0.1)
    return _checkpoint(tmp_path, peft, hyper_parameters={"lora": LORA}), peft


def test_lora_merged_and_as_an_adapter(tmp_path):
    """Adapters merged layer by layer within each shard equal PEFT's merge_and_unload then save_pretrained; with
    --lora=adapter, PeftModel.from_pretrained loads the trained adapters."""
    checkpoint, peft = _lora_checkpoint(tmp_path)
    export_checkpoint(checkpoint, tmp_path / "merged", max_shard_size=SHARD)
    meta = _meta_like(tiny_model("llama"))
    save_pretrained_whole(checkpoint, meta, tmp_path / "peer", lora=LORA, max_shard_size=SHARD)
    assert_same_directory(tmp_path / "merged", tmp_path / "peer")
    export_checkpoint(checkpoint, tmp_path / "adapter", lora="adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    trained = {name: p for name, p in peft.named_parameters() if "lora_" in name}
    assert trained and all(torch.equal(loaded.get_parameter(name), p) for name, p in trained.items())


def test_each_shard_is_read_by_key_in_bounded_batches(tmp_path, monkeypatch):
    """Every tensor is read once, in reads of at most the batch size (one tensor when larger), even within a shard
    several times larger: never a whole shard, nor the whole model, at once."""
    checkpoint = _checkpoint(tmp_path, tiny_model("llama"))
    reads: list[int] = []
    load = source.dcp.load

    def counting_load(state, **options):
        reads.append(sum(tensor.nbytes for tensor in state.values()))
        return load(state, **options)

    monkeypatch.setattr(source.dcp, "load", counting_load)
    monkeypatch.setattr(writing, "_READ_BYTES", 10_000)
    export_checkpoint(checkpoint, tmp_path / "export", max_shard_size=10 * SHARD)
    largest = max(p.nbytes for p in tiny_model("llama").parameters())
    shards = [p.stat().st_size for p in (tmp_path / "export").glob("*.safetensors")]
    assert len(shards) > 1 and max(shards) > 2 * largest, shards
    assert len(reads) > 10 and max(reads) <= max(10_000, largest), reads
    assert sum(reads) < sum(shards), (sum(reads), sum(shards))  # each tensor once (the files add their headers)


def test_an_interrupted_export_leaves_no_directory_and_the_previous_one_whole(tmp_path, monkeypatch):
    """Killed while writing its third tensor, an export leaves neither a half-written directory nor its staging;
    over a previous export, the previous one stays as it was. A missing weight is named."""
    checkpoint = _checkpoint(tmp_path, tiny_model("llama"))
    write, calls = SafetensorsFile.write, []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("No space left on device")
        write(self, name, tensor)

    monkeypatch.setattr(SafetensorsFile, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(checkpoint, tmp_path / "export", max_shard_size=SHARD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    monkeypatch.setattr(SafetensorsFile, "write", write)
    export_checkpoint(checkpoint, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    monkeypatch.setattr(SafetensorsFile, "write", failing_write)
    calls.clear()
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(checkpoint, tmp_path / "export", max_shard_size=SHARD)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export"]


def test_a_missing_weight_is_named(tmp_path):
    model = tiny_model("llama")
    del model.model.norm.weight  # saved without it, as a checkpoint of another model would be
    model.model.norm.register_parameter("weight", None)
    checkpoint = _checkpoint(tmp_path, model)
    with pytest.raises(ValueError, match=r"lacks the weight model\.norm\.weight"):
        export_checkpoint(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export").exists()
