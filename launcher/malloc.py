"""glibc heap tuning for the training process.

Each step frees a few MB of CPU scratch memory at once (the loss, its graph, activations); glibc
then returns the top of the heap to the OS and faults it back in page by page on the next step:
measured here, ~900 extra page faults and ~0.8 ms per tiny-model step (bench/loop_overhead.py).
Fixed thresholds keep that memory in the process. Where the user set MALLOC_* variables, or the
C library is not glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 128 << 20
# Setting either threshold switches off glibc's dynamic mmap threshold, so set both. 32 MiB is
# the most that dynamic threshold ever reaches on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): below it a
# tensor is reused from the heap, as with glibc's defaults once warm; 16 MiB mapped and unmapped a
# 33 MB logits tensor of a small Llama every step (bench vs_trainer_hf: 0.82; docs/performance.md).
MMAP_THRESHOLD = 32 << 20


def tune_glibc_malloc(environ: dict[str, str] | None = None) -> bool:
    """Apply the thresholds with mallopt; True if applied."""
    env = os.environ if environ is None else environ
    if any(k.startswith("MALLOC_") for k in env):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            return False
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(
            M_TRIM_THRESHOLD, TRIM_THRESHOLD
        )
    except OSError as e:  # no usable C library: keep the allocator's defaults
        logger.debug("mallopt unavailable: %s", e)
        return False
    return bool(ok)
