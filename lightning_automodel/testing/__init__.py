"""What the tests, benchmarks/ and scripts/ share, importable without editing ``sys.path`` (as ``torch.testing``):
the gloo process harness, the tiny models, the parity checks against one process and the measurements they report.

Nothing else in ``lightning_automodel`` imports it. It needs no pytest: benchmarks run its checks where only the
package is installed.
"""
