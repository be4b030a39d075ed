"""torchtitan's own trainer set as ours (benchmarks/torchtitan_peer.py): the same Llama, weights, rows, layout and
optimizer.

torchtitan runs as its users run it: its ``Trainer`` built from ``Trainer.Config`` and stepped by ``train_step``, with
its Llama-3 model and ``parallelize_llama`` (tensor parallel with sequence parallel and loss parallel, FSDP2 per block),
its chunked cross-entropy (``ChunkedLossWrapper``: lm_head and the loss over 8 sequence chunks) and its AdamW container.
Set for a CPU: a fused q/k/v projection (its default); SDPA attention, as FlexAttention is always torch.compile'd; the
``partial_dtensor`` SPMD backend (model-parallel axes as DTensors), as its default ``spmd_types`` needs a torch nightly;
for-loop AdamW, what torch's AdamW (ours) runs on CPU; no activation checkpointing (its default is selective), as ours.
Its weights are the seeded Hugging Face model's, saved as safetensors and read by its checkpointer
(``initial_load_in_hf``); rms_norm eps and rope theta are Hugging Face's. Beyond ours, its step computes the global
gradient norm (max_norm 1e9: it never clips). Its Trainer turns Python's garbage collector off for the whole process,
ours included. The CPU workarounds: benchmarks/torchtitan_cpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from benchmarks.torchtitan_cpu import import_torchtitan, sum_reductions
from lightning_automodel.testing.peer_setup import CONFIG, ROWS, STEPS, TOKENS, WARMUP, global_batch


def torchtitan_trainer(*, dp: int, tp: int, directory: str):
    """torchtitan's Trainer over (dp_shard, tp) as ours, to load the Hugging Face weights from ``directory``."""
    import_torchtitan()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    tokenizer, dataloader = data_components()
    config = Trainer.Config(
        model_spec=llama_spec(),
        hf_assets_path=None,
        dump_folder=directory,
        tokenizer=tokenizer,
        dataloader=dataloader,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=CONFIG["vocab_size"])),
        optimizer=replace(
            default_adamw(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01), implementation="for-loop"
        ),  # torch's AdamW defaults, as ours
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),  # constant, as ours
        training=TrainingConfig(
            local_batch_size=ROWS // dp,
            seq_len=TOKENS,
            steps=WARMUP + STEPS + 2,  # the timed ones, then one counting collectives and one tracking memory
            max_norm=1e9,
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,  # also: zero_grad(set_to_none=True), as ours
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=dp,
            tensor_parallel_degree=tp,
            enable_sequence_parallel=True,
            spmd_backend="partial_dtensor",
        ),
        checkpoint=CheckpointManager.Config(
            enable=True,
            initial_load_path=directory,
            initial_load_in_hf=True,
            initial_load_model_only=True,
            interval=10**9,
        ),
        activation_checkpoint=None,  # its default is selective activation checkpointing; ours keeps activations
        metrics=MetricsProcessor.Config(log_freq=10**9),  # only the first step's loss: logging costs collectives
    )
    trainer = config.build()
    sum_reductions(trainer)
    return trainer


def llama_spec():
    """torchtitan's Llama-3 (its own builders, as its debugmodel flavor) shaped and set as the Hugging Face model.

    SDPA attention: models/common/config_utils.py:97 refuses "sdpa" for language models, and FlexAttention is always
    torch.compile'd (models/common/attention.py:277). The SDPA module goes into the built config as torchtitan's own
    graph_trainer tests put it (experiments/graph_trainer/common_utils.py:66-70)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from transformers import LlamaConfig

    hf = LlamaConfig(**CONFIG)
    dim, heads, vocab = hf.hidden_size, hf.num_attention_heads, hf.vocab_size
    rope = ComplexRoPE.Config(
        dim=dim // heads, max_seq_len=hf.max_position_embeddings, theta=hf.rope_parameters["rope_theta"], scaling="none"
    )
    layers = llama3._build_llama3_layers(
        n_layers=hf.num_hidden_layers,
        dim=dim,
        n_heads=heads,
        n_kv_heads=hf.num_key_value_heads,
        hidden_dim=hf.intermediate_size,
        fuse_qkv=True,
        rope=rope,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = hf.rms_norm_eps
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=hf.rms_norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=layers,
    )
    return replace(llama3.model_registry("debugmodel"), flavor="peers", model=model)


def data_components():
    """The configs of a tokenizer that is never used and of a loader of this rank's rows, the same every step."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        """The Trainer builds a tokenizer; the rows are tokens already."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, *, tokenizer_path):
            super().__init__()

        def encode(self, *args, **kwargs):
            raise NotImplementedError

        def decode(self, *args, **kwargs):
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return CONFIG["vocab_size"]

    class RowsLoader(BaseDataLoader):
        """The dp rank's rows of peers.py's batch. torchtitan takes inputs and labels apart: the labels are the next
        tokens with the last position ignored, so that the loss averages the 255 predictions a row that ours does
        (feeding 255 tokens instead would break sequence parallel's divisibility)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, **_):
            self.rows = global_batch().chunk(dp_world_size)[dp_rank]
            self.labels = torch.cat([self.rows[:, 1:], torch.full((len(self.rows), 1), IGNORE_INDEX)], dim=1)

        def __iter__(self):
            while True:
                yield {"input": self.rows.clone()}, self.labels.clone()

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    return NoTokenizer.Config(), RowsLoader.Config()


def torchtitan_step(trainer, data) -> None:
    """What ``Trainer.train`` does each step, less its profiler, checkpoint and validation hooks."""
    trainer.step += 1
    trainer.train_step(data)


def logged_losses(trainer) -> list[float]:
    """The losses ``train_step`` logs (it returns none): the global mean, on the first step and every log_freq."""
    losses = []
    log = trainer.metrics_processor.log

    def record(step: int, global_avg_loss: float, *args, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    return losses
