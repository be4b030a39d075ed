"""The coverage report's machinery (``scripts/coverage.py``, ``docs/coverage.md``): every causal-LM type of the
installed transformers built tiny, trained a step at a layout in launches of two gloo ranks, and given a verdict
against one process."""
