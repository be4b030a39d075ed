"""Packed documents kept apart at cp=1: a packed row's logits and loss are those of each document run alone, and a
model that would let them see each other is refused before training."""

import json

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_automodel.data import ChatDataModule, TextDataModule, cache
from lightning_automodel.hf.document_masking import packed_documents_problem
from lightning_automodel.hf.shrink import tiny_config as shrunk_config
from lightning_automodel.lm import CausalLMModule
from lightning_automodel.testing.models import VOCAB, tiny_config


def fit(module, data):
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    L.Trainer(accelerator="cpu", devices=1, max_steps=1, **options).fit(module, data)


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_computes_each_document_alone(attention):
    """Three documents and padding in one row, position ids restarting: the logits of each equal the document run
    alone (transformers masks by the position ids on CPU too), and so the summed loss of the row."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=attention).eval()
    documents = [torch.randint(0, VOCAB, (length,)) for length in (5, 7, 3)]
    row = torch.cat([*documents, torch.zeros(1, dtype=torch.long)]).unsqueeze(0)
    positions = torch.cat([torch.arange(len(document)) for document in [*documents, row[0, :1]]]).unsqueeze(0)
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=document.unsqueeze(0)).logits[0] for document in documents])
        crossing = model(input_ids=row, use_cache=False).logits[0, : len(alone)]
    assert (packed[: len(alone)] - alone).abs().max() < 1e-5
    assert (crossing - alone).abs().max() > 1e-2, "the check cannot tell packed documents from one"


def test_models_that_let_documents_see_each_other_are_refused(tmp_path):
    """A state-space mixer carries state from one document into the next: refused by name before training, with
    the fix; Llama passes."""
    assert packed_documents_problem(AutoModelForCausalLM.from_config(tiny_config("llama"))) is None
    problem = packed_documents_problem(AutoModelForCausalLM.from_config(shrunk_config("mamba")))
    assert problem.startswith("MambaForCausalLM lets packed documents see each other"), problem
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    data = ChatDataModule(train_files=str(tmp_path / "sft.jsonl"), seq_len=16)
    mamba = {**shrunk_config("mamba").to_dict(), "vocab_size": 320}
    module = CausalLMModule(config=mamba)
    with pytest.raises(ValueError, match=r"MambaForCausalLM lets packed documents .* Set pack=False"):
        fit(module, data)
    (tmp_path / "a.txt").write_text("some text")
    apart = TextDataModule(train_files=str(tmp_path / "a.txt"), seq_len=16, separate_documents=False)
    fit(CausalLMModule(config=mamba), apart)
