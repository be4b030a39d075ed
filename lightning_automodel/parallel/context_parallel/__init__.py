"""Context parallel (``cp``): every sequence split over the cp ranks, attention over all of it (Llama 3's way). Each
rank keeps its share of a sequence's tokens through every layer (:mod:`.sequence_split`); only attention needs the
others', and gathers their keys and values (:mod:`.attention`). The model's call takes the whole batch and splits it
(:mod:`.model`); models whose class does not compose that way are refused before any collective (:mod:`.problems`).
See docs/context_parallel.md."""

from lightning_automodel.parallel.context_parallel.attention import (
    ATTENTION,
    CPAttention,
    attention_kernel,
    context_parallel_attention,
)
from lightning_automodel.parallel.context_parallel.model import (
    ContextParallel,
    ContextParallelModel,
    check_cp_with_pipeline,
    context_parallel_model,
    context_parallel_of,
)
from lightning_automodel.parallel.context_parallel.problems import context_parallel_problem
from lightning_automodel.parallel.context_parallel.sequence_split import SequenceSplit, documents, token_indices

__all__ = [
    "ATTENTION",
    "CPAttention",
    "ContextParallel",
    "ContextParallelModel",
    "SequenceSplit",
    "attention_kernel",
    "check_cp_with_pipeline",
    "context_parallel_attention",
    "context_parallel_model",
    "context_parallel_of",
    "context_parallel_problem",
    "documents",
    "token_indices",
]
