"""Shared test set-up: no checkout folder on children's paths, Triton's CPU interpreter, small thread counts."""

import os

import torch

# Every process a test starts (`python -c`, `python -m`, the services and their engine cores) runs without the
# working directory or its script's folder first on sys.path, so no folder of this checkout shadows a library.
os.environ["PYTHONSAFEPATH"] = "1"

# Triton kernels launch on CPU only through the interpreter, which must be chosen before
# any @triton.jit decorator runs (../shared/PITFALLS.md).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI has 2 cores; tests that start several processes set their own thread counts.
torch.set_num_threads(min(2, torch.get_num_threads()))
