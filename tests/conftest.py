"""Test-wide settings."""

import torch

# The models under test are small: one thread is as fast, and OpenMP threads spinning on a
# 2-core machine next to the gloo test processes would only slow everything down.
torch.set_num_threads(1)
