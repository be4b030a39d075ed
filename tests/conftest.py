import os
import sys

# The gloo workers import the test helpers (harness, models, parity) by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
