"""Shared test set-up: Triton's CPU interpreter and small torch thread counts."""

import os

import torch

# Triton kernels launch on CPU only through the interpreter, which must be chosen before
# any @triton.jit decorator runs (../shared/PITFALLS.md).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI has 2 cores; tests that start several processes set their own thread counts.
torch.set_num_threads(min(2, torch.get_num_threads()))
