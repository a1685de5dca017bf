"""Seeding every generator that decides a trajectory."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds all CUDA devices


def enable_full_determinism(seed: int) -> None:
    """set_seed plus deterministic kernels only. The launcher sets CUBLAS_WORKSPACE_CONFIG
    before CUDA initialises (core never touches the environment)."""
    set_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
