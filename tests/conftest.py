"""Test-wide settings."""

import os

import torch

# The models under test are small: one thread is as fast, and OpenMP threads spinning on a
# 2-core machine next to the gloo test processes would only slow everything down.
torch.set_num_threads(1)

# The heartbeat's and the failure diagnosis's intervals at half their defaults, in this process
# and every process a test starts: a dead peer is noticed and named in half the time. What a
# job runs with is tested too (tests/test_liveness.py runs a diagnosis at the defaults).
os.environ.setdefault("GOSSAMER_LIVENESS_SCALE", "0.5")
