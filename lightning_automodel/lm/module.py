"""CausalLMModule: a ready LightningModule for Hugging Face causal language models, with optional LoRA.

It is what a user would write with the strategy's public API, done once and tested: the model is built on the
meta device (the strategy allocates only each rank's shards and reads pretrained weights shard by shard), the
loss is averaged over every scored token of the global batch whichever rank holds them, and the metrics are
token-weighted and reduced over the data-parallel ranks only. It runs under any Lightning strategy; under
others than ``AutoModelParallelStrategy`` the model is built with real weights by transformers itself.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_automodel.hf.document_masking import packed_documents_problem
from lightning_automodel.hf.loading import from_pretrained
from lightning_automodel.hf.peft import unwrap_peft, with_lora
from lightning_automodel.lm.building import architectures, auto_model_class, new_model_config, tokenizer_files
from lightning_automodel.lm.limits import check_batch, check_seq_len, check_tokenizer
from lightning_automodel.lm.metrics import TokenMean, TokenPerplexity
from lightning_automodel.lm.optimization import Schedule, adamw_of_hparams
from lightning_automodel.lm.predictions import row_scores
from lightning_automodel.lm.summary import TrainingSummary
from lightning_automodel.lm.throughput import ReplicaThroughputMonitor
from lightning_automodel.parallel.chunked_loss import check_loss_chunks, chunked_causal_lm_loss_sum, chunking_problem
from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.experts.load_balancing_loss import load_balancing_loss
from lightning_automodel.parallel.full_tensor import full_tensor
from lightning_automodel.parallel.loss import (
    causal_lm_loss_sum,
    data_parallel_group,
    global_token_mean,
    next_token_hit_mask,
)
from lightning_automodel.parallel.pipeline import pipeline_of
from lightning_automodel.planning.flops import flops_per_token
from lightning_automodel.planning.memory.optimizer_step import AdamWImplementation, check_adamw
from lightning_automodel.strategy import AutoModelParallelStrategy

_STAGES = ("train", "val", "test")
# A vision-language model's inputs besides the tokens, passed on where a batch has them (see docs/vision.md).
_IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes", "mm_token_type_ids", "token_type_ids")


class CausalLMModule(L.LightningModule):
    """Train, evaluate and score a Hugging Face causal LM, or a vision-language model (image-text-to-text: a config
    with a vision tower's, e.g. LLaVA's), whose batches' image inputs (``pixel_values``, ``image_grid_thw``, ...) are
    passed to it with the tokens.

    Where the data module gives one fine-tuning record a row (``pack=False``), validation and test also log
    ``answer_accuracy``: the share of records whose every answer token is the model's first choice, given the
    answer's earlier tokens (for a one-answer record, whether greedy decoding gives the answer exactly).

    Args:
        model: a local Hugging Face model directory to start from (its weights are loaded), or None to train from
            ``config``.
        config: with ``model``, overrides of its config (``{"attn_implementation": "sdpa"}``); without, a whole
            config to build a new model from, with its ``model_type`` (``{"model_type": "llama", "hidden_size":
            ...}``). A missing ``vocab_size`` is taken from the data module's tokenizer (rounded up to a
            multiple of 64, so that tensor parallelism divides it), and so are missing ``bos_token_id``,
            ``eos_token_id`` and ``pad_token_id`` (an exported model's ``generate`` stops at the tokenizer's EOS);
            for a vision-language model in its ``text_config``, and a missing ``image_token_id`` is the data
            module's processor's.
        lora: ``peft.LoraConfig`` arguments (``{"r": 16, "target_modules": ["q_proj", "v_proj"]}``): only the
            adapters train.
        dtype: the weights' dtype when loading ``model`` (``"auto"``: the checkpoint's). Training precision is
            ``Trainer(precision=...)``'s.
        learning_rate, weight_decay, betas: AdamW's; weight decay applies to matrices only, not to norms and
            biases.
        warmup_steps: steps of linear warm-up to ``learning_rate``.
        schedule: the decay after warm-up, to ``min_lr_ratio * learning_rate`` at the last step
            (``Trainer(max_steps=...)`` or the epochs' steps).
        loss_chunks: run the head and the loss this many sequence chunks at a time, so that the logits (and in
            backward their log-softmax and gradient) never exist whole, for the same FLOPs and, where tp divides the
            sequence, the same collectives (see :mod:`lightning_automodel.parallel.chunked_loss`); 1: the logits
            whole.
        adamw: ``"foreach"`` (torch's default on GPUs: a temporary the size of a param group's shards after
            backward) or ``"fused"`` (in place, none); the plan and ``layout="auto"`` count the one chosen
            (:mod:`lightning_automodel.planning.memory.optimizer_step`).
    """

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
        dtype: str = "auto",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        schedule: Schedule = "cosine",
        min_lr_ratio: float = 0.1,
        loss_chunks: int = 1,
        adamw: AdamWImplementation = "foreach",
    ) -> None:
        super().__init__()
        if model is None and not (config or {}).get("model_type"):
            raise ValueError(
                "CausalLMModule needs a model: `model=` a local Hugging Face model directory, or `config=` a whole"
                ' config with its model_type, e.g. {"model_type": "llama", "hidden_size": 256, ...}.'
            )
        if schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule={schedule!r} is not one of 'cosine', 'linear', 'constant'.")
        check_loss_chunks(loss_chunks)
        check_adamw(adamw)
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.tokenizer: Any = None
        self.processor: Any = None  # a vision-language data module's, saved with the checkpoints
        self._answers_scored = False
        self._batch_shape: tuple[int, int] = (0, 0)
        self._load_balancing_checked = False
        self._chunking_checked = False
        for stage in _STAGES:  # train_metrics, val_metrics, test_metrics
            sync_on_step = stage == "train"  # a step's logged value is the global batch's
            metrics = {
                "loss": TokenMean(dist_sync_on_step=sync_on_step),
                "perplexity": TokenPerplexity(dist_sync_on_step=sync_on_step),
                "accuracy": TokenMean(dist_sync_on_step=sync_on_step),
                "answer_accuracy": TokenMean(dist_sync_on_step=sync_on_step),
            }
            setattr(self, f"{stage}_metrics", nn.ModuleDict(metrics))

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls this at every stage: the trained model stays
            return
        self.tokenizer = self._find_tokenizer()
        ours = isinstance(self.trainer.strategy, AutoModelParallelStrategy)
        datamodule = self.trainer.datamodule
        self.processor = getattr(datamodule, "processor", None)
        self._answers_scored = getattr(datamodule, "fine_tuning", False) and not getattr(datamodule, "pack", True)
        seq_len = getattr(datamodule, "seq_len", None)
        self.model = self.build_model(self.tokenizer, meta=ours, seq_len=seq_len, processor=self.processor)
        if getattr(datamodule, "keeps_documents_apart", False) and (problem := packed_documents_problem(self.model)):
            raise ValueError(
                f"{problem}: {type(datamodule).__name__} packs several documents in a row, told apart by their"
                " position ids only. Set pack=False (one document a row, padded), or separate_documents=False for"
                " pre-training text (attention then crosses documents)."
            )

    def on_fit_start(self) -> None:
        self._reduce_metrics_over_data_parallel_ranks()

    def on_validation_start(self) -> None:
        self._reduce_metrics_over_data_parallel_ranks()

    def on_test_start(self) -> None:
        self._reduce_metrics_over_data_parallel_ranks()

    def _reduce_metrics_over_data_parallel_ranks(self) -> None:
        """tp peers hold the same numbers and must count once. After the strategy's setup, where the mesh is known
        under any layout (``layout="auto"`` chooses it there)."""
        group = data_parallel_group(self.device_mesh) if self.device_mesh is not None else None
        for split in _STAGES:
            metrics = getattr(self, f"{split}_metrics").to(self.trainer.strategy.root_device)
            for metric in metrics.values():
                metric.process_group = group

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """The logits (vocabulary-sharded under tensor parallelism)."""
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.model(**inputs, use_cache=False).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step("val", batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step("test", batch)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Each sequence's summed next-token loss and scored-token count (score documents, compute perplexities),
        on every rank under any layout (see :func:`~lightning_automodel.lm.predictions.row_scores`);
        :class:`~lightning_automodel.lm.predictions.PredictionWriter` writes them to a file."""
        check_batch(batch, self.hf_config)
        if "labels" not in batch:  # refused on every rank, before any stage waits for the last one
            raise ValueError("CausalLMModule's predict scores each sequence against its labels: give batches labels.")
        self._batch_shape = tuple(batch["input_ids"].shape)
        return row_scores(self.model, labels=batch["labels"], **_model_inputs(batch))

    def _step(self, stage: str, batch: dict[str, Tensor]) -> Tensor:
        check_batch(batch, self.hf_config)
        self._batch_shape = tuple(batch["input_ids"].shape)
        if self.hparams.loss_chunks > 1 and not self._chunking_checked:
            self._check_chunking()
        if pipeline_of(self.model) is not None or context_parallel_of(self.model) is not None:
            loss, loss_sum, tokens, hits = self._split_step(stage, batch)
        else:
            loss, loss_sum, tokens, hits = self._whole_step(stage, batch)
        metrics = getattr(self, f"{stage}_metrics")
        metrics["loss"](loss_sum, tokens)
        metrics["perplexity"](loss_sum, tokens)
        metrics["accuracy"](hits, tokens)
        on_step = stage == "train"
        for name, metric in metrics.items():
            if name == "answer_accuracy" and not metric.update_called:  # counted by _count_answers only
                continue
            self.log(f"{stage}_{name}", metric, on_step=on_step, on_epoch=not on_step, prog_bar=name != "perplexity")
        return loss

    def _whole_step(self, stage: str, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The loss to train on, this rank's summed loss, scored tokens and next-token hits, from the logits. A loss
        summed on vocabulary-sharded logits is a (replicated) DTensor: the metrics, and a sum with plain terms, take
        its full_tensor."""
        labels = batch["labels"]
        if self.hparams.loss_chunks > 1:
            loss_sum, tokens, hits = chunked_causal_lm_loss_sum(
                self.model, labels=labels, chunks=self.hparams.loss_chunks, **_model_inputs(batch)
            )
            return global_token_mean(loss_sum, tokens, self.device_mesh), full_tensor(loss_sum), tokens, hits
        outputs = self.model(**_model_inputs(batch), use_cache=False)
        loss_sum, tokens = causal_lm_loss_sum(outputs.logits, labels)
        loss = global_token_mean(loss_sum, tokens, self.device_mesh)
        if getattr(outputs, "aux_loss", None) is not None:  # added to this rank's plain copy of the replicated loss
            loss = full_tensor(loss) + self._load_balancing_loss(stage, outputs, batch.get("attention_mask"))
        hit, scored = next_token_hit_mask(outputs.logits, labels)
        if stage != "train" and self._answers_scored:
            self._count_answers(stage, hit, scored)
        return loss, full_tensor(loss_sum), tokens, hit.sum()

    def _count_answers(self, stage: str, hit: Tensor, scored: Tensor) -> None:
        """Each row with answer tokens is one record: right where every answer token is ranked first."""
        answered = scored.any(dim=1)
        right = (hit | ~scored).all(dim=1) & answered
        getattr(self, f"{stage}_metrics")["answer_accuracy"](right.sum(), answered.sum())

    def _check_chunking(self) -> None:
        """Refuse loss_chunks where chunking cannot give the whole logits' loss, on every rank before any collective
        of the step (see :func:`~lightning_automodel.parallel.chunked_loss.chunking_problem`)."""
        if (problem := chunking_problem(self.model)) is not None:
            raise ValueError(f"loss_chunks={self.hparams.loss_chunks}: {problem}. Use loss_chunks=1.")
        self._chunking_checked = True

    def _split_step(self, stage: str, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The same when the model's call splits the batch: under pipeline parallel the last stage computes them,
        micro-batch by micro-batch; under context parallel each rank its share of the sequences. The call's loss
        includes a mixture-of-experts model's load-balancing loss over the global batch, logged apart."""
        outputs = self.model(**_model_inputs(batch), labels=batch["labels"])
        if outputs.aux_loss is not None:
            on_step = stage == "train"
            self.log(f"{stage}_aux_loss", outputs.aux_loss, on_step=on_step, on_epoch=not on_step)
        return outputs.loss, outputs.loss_sum, outputs.num_tokens, outputs.num_hits

    def _load_balancing_loss(self, stage: str, outputs: Any, attention_mask: Tensor | None) -> Tensor:
        """The mixture-of-experts auxiliary loss (``output_router_logits``), weighted as the model weighs it, over
        the global batch (see :mod:`lightning_automodel.parallel.experts.load_balancing_loss`); logged with each
        layer's expert load imbalance, the same on every rank."""
        hf_model = unwrap_peft(self.model)
        options = dict(num_experts=hf_model.num_experts, top_k=hf_model.num_experts_per_tok)
        if not self._load_balancing_checked:
            own, _ = load_balancing_loss(outputs.router_logits, attention_mask=attention_mask, **options)
            if not torch.allclose(own, outputs.aux_loss.to(own), rtol=1e-5, atol=1e-7):
                raise ValueError(
                    f"{type(hf_model).__name__}'s auxiliary loss ({outputs.aux_loss.item():.6g} on this batch) is not"
                    f" the load-balancing loss CausalLMModule sums over the data-parallel ranks ({own.item():.6g}):"
                    " it would be this rank's alone. Set output_router_logits=False in the model's config, or train"
                    " it with a LightningModule of your own."
                )
            self._load_balancing_checked = True
        group = data_parallel_group(self.device_mesh)
        aux_loss, load = load_balancing_loss(
            outputs.router_logits, attention_mask=attention_mask, group=group, **options
        )
        on_step = stage == "train"
        self.log(f"{stage}_aux_loss", aux_loss.detach(), on_step=on_step, on_epoch=not on_step)
        for layer, imbalance in enumerate(load.imbalance()):
            self.log(f"{stage}_expert_imbalance/layer_{layer}", imbalance, on_step=on_step, on_epoch=not on_step)
        return hf_model.router_aux_loss_coef * aux_loss

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_of_hparams(self, self.hparams, total_steps=self.trainer.estimated_stepping_batches)

    def configure_callbacks(self) -> list[Callback]:
        """Tokens/s and MFU (Lightning's ThroughputMonitor, each model replica counted once), and a summary at the
        end of fit."""
        return [
            ReplicaThroughputMonitor(batch_size_fn=self._rows, length_fn=self._tokens, window_size=10),
            TrainingSummary(),
        ]

    @property
    def hf_config(self) -> Any:
        """The built model's Hugging Face config (the base model's, under LoRA)."""
        return unwrap_peft(self.model).config

    @property
    def loss_chunks(self) -> int:
        """What the strategy plans the logits' memory by (its :class:`~lightning_automodel.strategy.module_hints.
        ModuleHints`)."""
        return self.hparams.loss_chunks

    @property
    def adamw(self) -> AdamWImplementation:
        """How AdamW steps, which the strategy plans the optimizer step's memory by (its
        :class:`~lightning_automodel.strategy.module_hints.OptimizerHints`)."""
        return self.hparams.adamw

    @property
    def flops_per_batch(self) -> int:
        """The FLOPs of this rank's batch: its model replica's work (ReplicaThroughputMonitor's device)."""
        return flops_per_token(self.model, self._batch_shape[1], training=self.training) * self._tokens(None)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What `lightning-automodel export` needs to write a Hugging Face directory from the checkpoint alone.
        # The model's class is recorded among the config's architectures, as save_pretrained records it; a
        # processor's files are saved in place of its tokenizer's, which they hold.
        recorded = self.hf_config.to_dict()
        checkpoint["hf_config"] = recorded | {"architectures": architectures(unwrap_peft(self.model))}
        saved = self.processor if self.processor is not None else self.tokenizer
        checkpoint["tokenizer_files"] = tokenizer_files(saved) if saved is not None else None

    def _rows(self, batch: Any) -> int:
        return self._batch_shape[0]

    def _tokens(self, batch: Any) -> int:
        return self._batch_shape[0] * self._batch_shape[1]

    def _find_tokenizer(self) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None)
        if getattr(datamodule, "tokenizer", None) is not None:
            return datamodule.tokenizer
        if self.hparams.model is not None:
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(self.hparams.model)
            except (OSError, ValueError):
                return None
        return None

    def build_model(
        self, tokenizer: Any = None, *, meta: bool, seq_len: int | None = None, processor: Any = None
    ) -> nn.Module:
        """The Hugging Face model these hyperparameters describe, with its LoRA adapters: a causal LM, or an
        image-text-to-text model where the config has a vision tower's.

        ``meta=True`` builds it on the meta device, for ``AutoModelParallelStrategy`` (which allocates each rank's
        shards and fills them from the checkpoint, or initialises them as transformers would the whole model) or
        for a plan report; ``meta=False`` has transformers load or initialise it whole. A ``tokenizer`` larger than
        the model's vocabulary, or rows of ``seq_len`` longer than its positions, are refused before any weight is
        read.
        """
        hparams = self.hparams
        config = self.model_config(tokenizer, processor=processor)
        if tokenizer is not None:
            check_tokenizer(tokenizer, config, pretrained=hparams.model)
        if seq_len is not None:
            check_seq_len(seq_len, config)
        overrides = dict(hparams.config or {})
        dtype = hparams.dtype if hparams.dtype == "auto" else getattr(torch, hparams.dtype)
        model_class = auto_model_class(config)
        if hparams.model is not None and meta:
            model = from_pretrained(hparams.model, dtype=dtype, model_class=model_class, **overrides)
        elif hparams.model is not None:
            model = model_class.from_pretrained(hparams.model, dtype=dtype, **overrides)
        else:
            with torch.device("meta") if meta else nullcontext():
                model = model_class.from_config(config)
        return with_lora(model, hparams.lora) if hparams.lora is not None else model

    def model_config(self, tokenizer: Any = None, *, processor: Any = None) -> Any:
        """The Hugging Face config of the model: ``model``'s with the ``config`` overrides, or ``config`` whole,
        completed from the tokenizer and processor (:func:`~lightning_automodel.lm.building.new_model_config`). No
        weights are read."""
        from transformers import AutoConfig

        hparams = self.hparams
        overrides = dict(hparams.config or {})
        if hparams.model is not None:
            return AutoConfig.from_pretrained(hparams.model, **overrides)
        return new_model_config(overrides, tokenizer, processor)


def _model_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor | None]:
    """What a model's call takes from a batch: position ids restarting at each document keep packed ones apart (with
    no cache: transformers reads packed documents from position ids only then, and a cache serves no training); a
    vision-language model's image inputs where the batch has them."""
    inputs = {name: batch.get(name) for name in ("input_ids", "attention_mask", "position_ids")}
    return inputs | {name: batch[name] for name in _IMAGE_INPUTS if name in batch}
