"""Vision-language records: rows whose labels are the answers alone, images of several sizes a record, pixels made
when a row is read; JSONL with image files and Parquet with image bytes give the same rows; bad records refused at
setup naming file and line; a collated batch runs through tiny LLaVA and Qwen2-VL models."""

import json

import pyarrow
import pyarrow.parquet
import pytest
import torch
from PIL import Image

from lightning_automodel.data import cache
from lightning_automodel.data.rows import IGNORE_INDEX
from lightning_automodel.data.vision import VisionChatDataModule
from lightning_automodel.data.vision.records import processor_digest
from lightning_automodel.data.vision.rows import collate_rows
from lightning_automodel.testing.vision.processors import llava_processor, qwen2_vl_processor, tiny_llava, tiny_qwen2_vl

SIZES = {"red.png": (10, 6), "blue.png": (20, 30), "green.png": (12, 8)}  # width, height: three sizes


def record(question, answer, images):
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    return {"messages": messages, "images": images}


RECORDS = [record("Both?", "red, blue", ["red.png", "blue.png"]), record("This?", "green", ["green.png"])]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


def write_images(directory):
    """The images as PNG files beside the records' JSONL file."""
    for name, size in SIZES.items():
        Image.new("RGB", size, name.split(".")[0]).save(directory / name)
    return directory


@pytest.fixture
def data(tmp_path):
    return write_images(tmp_path)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(one) + "\n" for one in records))
    return str(path)


def write_parquet(path, records, directory):
    """The records as datasets' Image feature stores them: each image a {"bytes", "path"} struct, bytes inline."""
    rows = [
        {**one, "images": [{"bytes": (directory / name).read_bytes(), "path": name} for name in one["images"]]}
        for one in records
    ]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return str(path)


def rows_of(files, processor, seq_len=96):
    module = VisionChatDataModule(train_files=files, processor=processor, seq_len=seq_len, batch_size=2, shuffle=False)
    module.setup("fit")
    return module, module.datasets["train"]


def answers(tokenizer, row):
    return tokenizer.decode(
        [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
    )


def test_rows_carry_ids_answer_labels_and_each_records_pixels(data, tmp_path):
    processor = llava_processor()
    processor.save_pretrained(tmp_path / "processor")  # read back by AutoProcessor, as a model's directory is
    module, rows = rows_of(write_jsonl(data / "vl.jsonl", RECORDS), str(tmp_path / "processor"))
    tokenizer, image_id = module.tokenizer, module.processor.image_token_id
    assert len(rows) == 2
    first, second = rows[0], rows[1]
    assert (first["input_ids"] == image_id).sum() == 8 and (second["input_ids"] == image_id).sum() == 4  # 4 an image
    assert answers(tokenizer, first) == "red, blue<eos>" and answers(tokenizer, second) == "green<eos>"
    assert (first["labels"][first["input_ids"] == image_id] == IGNORE_INDEX).all()
    assert first["pixel_values"].shape == (2, 3, 8, 8) and second["pixel_values"].shape == (1, 3, 8, 8)
    assert int(first["attention_mask"].sum()) == int((first["input_ids"] != tokenizer.pad_token_id).sum())
    batch = collate_rows([first, second])
    assert batch["pixel_values"].shape == (3, 3, 8, 8) and batch["input_ids"].shape == (2, 96)
    assert torch.equal(batch["pixel_values"][2], second["pixel_values"][0])
    module.num_workers = 1  # the module's loader collates so, pixels made in a forked worker (rows in order)
    loaded = next(iter(module.train_dataloader()))
    assert loaded.keys() == batch.keys() and all(torch.equal(loaded[name], batch[name]) for name in batch)


def test_jsonl_files_and_parquet_bytes_give_the_same_rows(data):
    processor = qwen2_vl_processor()
    _, from_files = rows_of(write_jsonl(data / "vl.jsonl", RECORDS), processor)
    _, from_bytes = rows_of(write_parquet(data / "vl.parquet", RECORDS, data), processor)
    assert len(from_files) == len(from_bytes) == 2
    for index in range(2):
        files, table = from_files[index], from_bytes[index]
        assert files.keys() == table.keys() >= {"input_ids", "labels", "pixel_values", "image_grid_thw"}
        assert all(torch.equal(files[name], table[name]) for name in files)
    # Qwen2-VL's tokens follow each image's size: 10x6 and 20x30 pixels give other grids.
    grids = from_files[0]["image_grid_thw"].tolist()
    assert grids[0] != grids[1]
    assert (from_files[0]["input_ids"] == processor.image_token_id).sum() == sum(t * h * w // 4 for t, h, w in grids)


def late_image(one, data):
    """An image of 16 tokens after 40 characters: it fits seq_len alone, but ends past it."""
    Image.new("RGB", (32, 32)).save(data / "late.png")
    one["messages"][0]["content"] = [{"type": "text", "text": "x" * 40}, {"type": "image"}]
    one["images"] = ["late.png"]


def test_a_datasets_object_with_the_image_feature_gives_the_same_rows(data):
    """A ``datasets.Dataset`` whose images column is ``List(Image())`` holding bytes, as the Hub's sets are."""
    datasets = pytest.importorskip("datasets")
    table = pyarrow.parquet.read_table(write_parquet(data / "vl.parquet", RECORDS, data))
    dataset = datasets.Dataset(table).cast_column("images", datasets.List(datasets.Image()))
    processor = qwen2_vl_processor()
    _, from_files = rows_of(write_jsonl(data / "vl.jsonl", RECORDS), processor)
    _, from_dataset = rows_of(dataset, processor)
    for index in range(2):
        assert all(torch.equal(from_files[index][name], from_dataset[index][name]) for name in from_files[index])


def test_a_template_without_generation_blocks_is_rendered_turn_by_turn(data):
    """Each answer is what its turn adds (with the turn's closing newline), each first turns rendered with the images
    they hold: a second question brings its own image."""
    later = record("This?", "red", ["red.png"])
    later["messages"] += record("And this?", "green", ["green.png"])["messages"]
    later["images"] += ["green.png"]
    processor = llava_processor()
    processor.chat_template = processor.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    module, rows = rows_of(write_jsonl(data / "vl.jsonl", [RECORDS[0], later]), processor)
    _, marked = rows_of(write_jsonl(data / "marked.jsonl", [RECORDS[0], later]), llava_processor())
    assert all(torch.equal(rows[index]["input_ids"], marked[index]["input_ids"]) for index in range(2))
    assert answers(module.tokenizer, rows[0]) == "red, blue<eos>\n"
    assert answers(module.tokenizer, rows[1]) == "red<eos>\ngreen<eos>\n"
    assert (rows[1]["input_ids"] == module.processor.image_token_id).sum() == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda one, _: one.update(images=["gone.png"]), r"vl.jsonl, line 2, image 0: no image file .*gone.png"),
        (lambda one, _: one.update(images=["broken.png"]), r"vl.jsonl, line 2, image 0: .*broken.png is not an image"),
        (lambda one, _: one.update(images=[]), r"vl.jsonl, line 2: 1 image placeholders .* but 0 images"),
        (lambda one, _: one.update(images=["red.png", "blue.png"]), r"vl.jsonl, line 2: 1 image placeholders .* 2"),
        (lambda one, _: one.update(images=["large.png"]), r"vl.jsonl, line 2: 64 image tokens in a run .* seq_len=48"),
        (late_image, r"vl.jsonl, line 2: its images' tokens end at token 6\d, past seq_len=48"),
    ],
)
def test_bad_records_are_refused_naming_file_and_line(data, change, message):
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.new("RGB", (64, 64)).save(data / "large.png")  # 16 x 16 patches merged 2 x 2: 64 tokens
    bad = json.loads(json.dumps(RECORDS[1]))
    change(bad, data)
    with pytest.raises(ValueError, match=message):
        rows_of(write_jsonl(data / "vl.jsonl", [RECORDS[0], bad]), qwen2_vl_processor(), seq_len=48)


def test_a_parquet_rows_undecodable_bytes_name_the_row(data):
    path = write_parquet(data / "vl.parquet", RECORDS, data)
    table = pyarrow.parquet.read_table(path).to_pylist()
    table[1]["images"][0]["bytes"] = b"not an image"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(table), path)
    with pytest.raises(ValueError, match=r"vl.parquet, row 1, image 0: bytes of green.png is not an image"):
        rows_of(path, qwen2_vl_processor())


def loss_on_answers(model, batch):
    """The model's loss, and the same computed by hand over the positions whose labels are not -100."""
    output = model(**batch)
    logits, labels = output.logits[:, :-1], batch["labels"][:, 1:]
    kept = labels != IGNORE_INDEX
    return output.loss, torch.nn.functional.cross_entropy(logits[kept].float(), labels[kept])


def test_a_collated_batch_runs_through_tiny_llava_and_qwen2_vl(data):
    torch.manual_seed(0)
    for processor, model in ((llava_processor(), tiny_llava), (qwen2_vl_processor(), tiny_qwen2_vl)):
        module, rows = rows_of(write_jsonl(data / "vl.jsonl", RECORDS), processor)
        batch = collate_rows([rows[0], rows[1]])
        trained = batch["labels"] != IGNORE_INDEX
        assert module.tokenizer.decode(batch["input_ids"][trained].tolist()) == "red, blue<eos>green<eos>"
        loss, by_hand = loss_on_answers(model(processor), batch)
        assert torch.isfinite(loss) and torch.allclose(loss, by_hand, atol=1e-5)


def test_the_cache_key_follows_the_processors_own_settings():
    """LLaVA's patch size is the processor's, not its image processor's: a cache of another patch size's ids would
    be reused and fail in the model ("Image features and image tokens do not match")."""
    assert processor_digest(llava_processor(patch=4)) != processor_digest(llava_processor(patch=2))
    assert processor_digest(llava_processor()) == processor_digest(llava_processor())
