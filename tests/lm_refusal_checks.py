"""CausalLMModule's refusals inside gloo workers, each raised on every rank before any collective: uneven predict
batches, data the model cannot take, the chunked loss where the model's call computes the loss."""

from __future__ import annotations

import json

import torch.distributed as dist
from lm_checks import Rows, padded_rows
from loading_checks import remove
from torch.utils.data import DataLoader

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.lm import CausalLMModule, PredictionWriter
from lightning_automodel.testing.harness import shared_directory
from lightning_automodel.testing.models import tiny_config
from lightning_automodel.testing.trainer_parity import trainer


def check_predict_in_step_or_refused() -> dict:
    """Predict at dp=2 over an odd number of rows: Lightning's own split leaves one rank a batch more, which is
    refused on every rank (a hang otherwise); the data module's padded split predicts every row."""
    from lightning_automodel.data import DemoDataModule

    module = CausalLMModule(config=tiny_config("llama", vocab_size=320).to_dict())
    predict = trainer(AutoModelParallelStrategy())
    try:
        predict.predict(module, DataLoader(Rows(padded_rows(5, seed=3)), batch_size=1))
        raise AssertionError("uneven predict batches were not refused")
    except ValueError as error:
        message = str(error)
    assert "different numbers of batches ([3, 2])" in message, message
    data = DemoDataModule(seq_len=16, batch_size=2, num_documents=4, val_documents=2)  # 23 rows: one twice
    directory = shared_directory()
    writer = PredictionWriter(path=str(directory / "predictions.jsonl"))
    predict.callbacks.append(writer)
    outputs = predict.predict(module, datamodule=data)
    rows = sum(len(output["tokens"]) for output in outputs)
    assert rows == -(-len(data.datasets["test"]) // 2), (rows, len(data.datasets["test"]))  # dp=2, padded
    dist.barrier()  # rank 0 has written the file: every row once, the one predicted twice too
    written = [json.loads(line)["row"] for line in writer.path.read_text().splitlines()]
    assert written == list(range(len(data.datasets["test"]))), written
    remove(directory)
    # On nccl, evaluation under inference_mode breaks FSDP2's first unshard (seen on a GPU, where validate, test or
    # predict run first); gloo always takes no_grad, so what can be checked here is that the strategy turned it off.
    loops = (predict.validate_loop, predict.test_loop, predict.predict_loop)
    assert not any(loop.inference_mode for loop in loops)
    return {"refused": message[:60], "rows_predicted_here": rows}


def check_bad_data_refused_on_every_rank(tp: int) -> dict:
    """Data the model cannot take, refused before the first step: a tokenizer larger than the vocabulary, rows
    longer than the positions, a validation file that is not UTF-8. Every rank must raise (one raising alone would
    leave the others waiting in a collective); returns each refusal's message, with DIR for this rank's files."""
    from lightning_automodel.data import DemoDataModule, TextDataModule

    directory = shared_directory()  # every rank names the same files (the local rank 0 caches their tokens)
    if dist.get_rank() == 0:
        (directory / "train.txt").write_text("some text\n\nmore text\n")
        (directory / "val.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    dist.barrier()
    bytes_vocab = tiny_config("llama", vocab_size=320).to_dict()  # max_position_embeddings 64
    cases = {
        "vocabulary": (tiny_config("llama").to_dict(), DemoDataModule(seq_len=16, num_documents=8)),  # 128 < 258
        "positions": (bytes_vocab, DemoDataModule(seq_len=128, num_documents=8)),
        "file": (
            bytes_vocab,
            TextDataModule(str(directory / "train.txt"), val_files=str(directory / "val.txt"), seq_len=16),
        ),
    }
    refused = {}
    for case, (config, data) in cases.items():
        module = CausalLMModule(config=config)
        run = trainer(AutoModelParallelStrategy(tp=tp))
        try:
            run.fit(module, datamodule=data)
            raise AssertionError(f"{case}: not refused")
        except ValueError as error:
            refused[case] = str(error).replace(str(directory), "DIR")
        assert run.global_step == 0, case
    return refused


def check_chunked_loss_refused_where_the_call_computes_it() -> dict:
    """loss_chunks under pp=2: refused on every rank at the first step, before any collective of it."""
    module = CausalLMModule(config=tiny_config("llama").to_dict(), loss_chunks=4)
    try:
        trainer(AutoModelParallelStrategy(pp=2)).fit(module, DataLoader(Rows(padded_rows(4, seed=3)), batch_size=4))
    except ValueError as error:
        assert "loss_chunks=4: under pipeline or context parallel" in str(error), error
        return {"refused": str(error)[:60]}
    raise AssertionError("loss_chunks under pp was not refused")
