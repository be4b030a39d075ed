"""Vision records packed several a row (pack=True): each record's logits are those it gets alone (tiny LLaVA, and
tiny Qwen2-VL with M-RoPE, records of other image sizes and counts, SDPA and eager attention), the loss is on the
answers alone, and models whose packed records would see each other are refused."""

from types import SimpleNamespace

import pytest
import torch
import transformers
from test_vision_data import RECORDS, record, rows_of, write_images, write_jsonl
from transformers import Gemma3Processor, Idefics3Processor, Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

from lightning_automodel.data import cache
from lightning_automodel.data.rows import IGNORE_INDEX
from lightning_automodel.data.vision import VisionChatDataModule, packing
from lightning_automodel.data.vision.packing import packed_positions, packing_rope_index
from lightning_automodel.data.vision.rows import collate_rows
from lightning_automodel.hf.document_masking import packed_documents_problem
from lightning_automodel.testing.vision.models import IMAGE_TOKEN, tiny_vision_model, vision_batch
from lightning_automodel.testing.vision.processors import llava_processor, qwen2_vl_processor, tiny_llava, tiny_qwen2_vl

# Two images of other sizes, one, none, one: each record's image tokens at another place.
PACKED = [*RECORDS, record("Nothing?", "nothing", []), record("Big?", "blue, big", ["blue.png"])]
SEQ_LEN = 160


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


@pytest.fixture
def images(tmp_path):
    return write_images(tmp_path)


def packed_and_alone(directory, processor, name):
    """The module packing ``PACKED``, its rows, and the rows of each record alone (pack=False)."""
    files = write_jsonl(directory / f"{name}.jsonl", PACKED)
    module = VisionChatDataModule(train_files=files, processor=processor, seq_len=SEQ_LEN, pack=True, shuffle=False)
    module.setup("fit")
    _, alone = rows_of(files, processor, seq_len=SEQ_LEN)
    return module, module.datasets["train"], alone


def logits(model, rows):
    with torch.no_grad():
        return model(**collate_rows(rows), use_cache=False).logits


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_packed_record_computes_as_if_alone(images, family, attention):
    processor, build = {"llava": (llava_processor(), tiny_llava), "qwen2_vl": (qwen2_vl_processor(), tiny_qwen2_vl)}[
        family
    ]
    torch.manual_seed(0)
    model = build(processor)
    model.set_attn_implementation(attention)
    module, packed, alone = packed_and_alone(images, processor, family)
    assert 1 < len(packed) < len(alone) == len(PACKED)  # several records a row, more than one row
    batch = collate_rows([packed[index] for index in range(len(packed))])
    assert "attention_mask" not in batch
    if family == "qwen2_vl":
        assert batch["position_ids"].shape == (4, len(packed), SEQ_LEN)
    whole = logits(model, [packed[index] for index in range(len(packed))])
    checked = 0
    for index in range(len(packed)):
        start, positions = 0, packed[index]["position_ids"].reshape(-1, SEQ_LEN)[0]
        for number in range(int(packed.row_starts[index]), int(packed.row_starts[index + 1])):
            own = alone[number]
            end = start + int(own["attention_mask"].sum())
            assert positions[start] == 0 and torch.equal(
                packed[index]["input_ids"][start:end], own["input_ids"][: end - start]
            )
            expected = logits(model, [own])[0, : end - start]
            error = (whole[index, start:end] - expected).abs().max() / expected.abs().max()
            assert error < 1e-5, (family, attention, number, float(error))
            start, checked = end, checked + 1
    assert checked == len(PACKED)
    # The images in the records' order: the packed rows' pixels are the records' alone, one after the other.
    assert torch.equal(
        batch["pixel_values"], torch.cat([own["pixel_values"] for own in alone if "pixel_values" in own])
    )


def test_the_loss_is_on_the_answers_alone(images):
    processor = qwen2_vl_processor()
    torch.manual_seed(0)
    model = tiny_qwen2_vl(processor)
    module, packed, _ = packed_and_alone(images, processor, "loss")
    batch = collate_rows([packed[index] for index in range(len(packed))])
    trained = batch["labels"] != IGNORE_INDEX
    answers = module.tokenizer.decode(batch["input_ids"][trained].tolist())
    assert answers == "red, blue<eos>green<eos>nothing<eos>blue, big<eos>"
    starts = batch["position_ids"][0] == 0
    assert (batch["labels"][starts] == IGNORE_INDEX).all()  # a record's first token: the token before is another's
    with torch.no_grad():
        output = model(**batch, use_cache=False)
    shifted, labels = output.logits[:, :-1], batch["labels"][:, 1:]
    kept = labels != IGNORE_INDEX
    assert torch.allclose(output.loss, torch.nn.functional.cross_entropy(shifted[kept], labels[kept]), atol=1e-6)


def test_models_whose_packed_records_would_mix_are_refused(images, monkeypatch):
    files = write_jsonl(images / "vl.jsonl", PACKED)
    module = VisionChatDataModule(train_files=files, processor=llava_processor(), seq_len=SEQ_LEN, pack=True)
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=r"LlavaProcessor \(model type llava\) cann"):
        patch.setattr(packing, "PLAIN_POSITIONS", ())  # LLaVA as a model not checked: refused at setup
        module.setup("fit")
    with pytest.raises(ValueError, match=r"Gemma3Processor \(model type gemma3\).*sliding-window.*Set pack=False"):
        packing_rope_index(object.__new__(Gemma3Processor))
    with pytest.raises(ValueError, match=r"model type idefics3\).*checked for llava, qwen2_vl.* only"):
        packing_rope_index(object.__new__(Idefics3Processor))
    # Why Gemma 3 is refused: records whose images sit at other places differ packed (its sliding-window layers).
    model = tiny_vision_model("gemma3_vlm").eval()
    rows = vision_batch("gemma3_vlm", batch_size=2)
    ids, length = rows["input_ids"], rows["input_ids"].shape[1]
    ids[1, 1:5], ids[1, 6:10] = 7, IMAGE_TOKEN
    types = (ids == IMAGE_TOKEN).long()
    with torch.no_grad():
        alone = model(input_ids=ids, pixel_values=rows["pixel_values"], token_type_ids=types).logits
        packed = model(
            input_ids=ids.reshape(1, -1),
            pixel_values=rows["pixel_values"],
            token_type_ids=types.reshape(1, -1),
            position_ids=torch.arange(length).repeat(2)[None],
            use_cache=False,
        ).logits.reshape(alone.shape)
    assert torch.allclose(packed[0], alone[0], atol=1e-6) and not torch.allclose(packed[1], alone[1], atol=1e-2)


def test_the_text_check_passes_m_rope_models_their_four_position_rows():
    """CausalLMModule's check of packed documents gives Qwen2-VL four rows of positions (with three its text model
    builds no mask from them, and refused it)."""
    assert packed_documents_problem(tiny_vision_model("qwen2_vl")) is None


def test_a_row_of_records_without_images_gets_text_positions_in_all_four_rows(images):
    files = write_jsonl(images / "text.jsonl", [record("Hi?", "hello", []), record("Bye?", "bye", [])])
    module = VisionChatDataModule(train_files=files, processor=qwen2_vl_processor(), seq_len=SEQ_LEN, pack=True)
    module.setup("fit")
    row = module.datasets["train"][0]
    assert "pixel_values" not in row and row["position_ids"].shape == (4, SEQ_LEN)
    assert (row["position_ids"] == row["position_ids"][0]).all() and (row["position_ids"][0] == 0).sum() == 3


IMAGE, VISION_START, HIDDEN = 120, 121, 32
# Each family's tower, tiny: patches of 4 merged 2 x 2 into tokens as wide as the decoder.
TOWERS = {
    "qwen2_vl": (Qwen2VLProcessor, dict(embed_dim=16, hidden_size=HIDDEN)),
    "qwen2_5_vl": (
        Qwen2_5_VLProcessor,
        dict(hidden_size=16, intermediate_size=32, out_hidden_size=HIDDEN, window_size=16, fullatt_block_indexes=[1]),
    ),
    "qwen3_vl": (
        Qwen3VLProcessor,
        dict(
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=HIDDEN,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
    ),
}


def tiny_m_rope_model(model_type):
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text |= dict(num_key_value_heads=1, head_dim=16, rope_parameters=rope, bos_token_id=None, eos_token_id=None)
    vision = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    config = transformers.CONFIG_MAPPING[model_type](
        text_config=text,
        vision_config=vision | TOWERS[model_type][1],
        image_token_id=IMAGE,
        video_token_id=122,
        vision_start_token_id=VISION_START,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForImageTextToText.from_config(config).eval()


def m_rope_records():
    """Records of two images (other grids), none and one, each image's tokens after a vision-start token."""
    generator, records = torch.Generator().manual_seed(0), []
    for grids in ([(1, 4, 4), (1, 2, 6)], [], [(1, 6, 4)]):
        ids = [torch.randint(0, 100, (5,), generator=generator)]
        for t, h, w in grids:
            image = torch.full((t * h * w // 4,), IMAGE)
            ids += [torch.tensor([VISION_START]), image, torch.randint(0, 100, (3,), generator=generator)]
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4, generator=generator)
        records.append(
            {
                "input_ids": torch.cat(ids),
                "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
                "pixel_values": pixels,
            }
        )
    return records


def m_rope_logits(model, record, position_ids=None):
    inputs = {"input_ids": record["input_ids"][None], "mm_token_type_ids": (record["input_ids"] == IMAGE).long()[None]}
    if len(record["image_grid_thw"]):
        inputs |= {"pixel_values": record["pixel_values"], "image_grid_thw": record["image_grid_thw"]}
    with torch.no_grad():
        return model(**inputs, position_ids=position_ids, use_cache=False).logits[0]


@pytest.mark.parametrize("model_type", TOWERS)
def test_each_m_rope_family_computes_packed_records_as_if_alone(model_type):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the row's position ids made by the data module's own functions (the model
    type found from its processor's class); with the three M-RoPE rows alone, the records see each other."""
    model, records = tiny_m_rope_model(model_type), m_rope_records()
    processor = object.__new__(TOWERS[model_type][0])
    processor.image_processor = SimpleNamespace(merge_size=2)
    row = {name: torch.cat([record[name] for record in records]) for name in records[0]}
    row["mm_token_type_ids"] = (row["input_ids"] == IMAGE).long()
    row["position_ids"] = torch.cat([torch.arange(len(record["input_ids"])) for record in records])
    lengths, images = ([len(record[name]) for record in records] for name in ("input_ids", "image_grid_thw"))
    positions = packed_positions(row, lengths=lengths, images=images, rope_index=packing_rope_index(processor))
    alone = torch.cat([m_rope_logits(model, record) for record in records])
    packed = m_rope_logits(model, row, positions[:, None])
    assert (packed - alone).abs().max() / alone.abs().max() < 1e-5
    mixed = m_rope_logits(model, row, positions[1:, None])
    assert (mixed - alone).abs().max() / alone.abs().max() > 1e-2
