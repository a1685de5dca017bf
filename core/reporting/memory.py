"""Memory per stage and speed metrics, measured at stage boundaries only (nothing per step).

CPU: the process RSS sampled at each boundary, plus `ru_maxrss` (the process's high-water mark,
which the kernel tracks between samples): when it rose during a stage, the stage set it. When
it did not, the stage's peak is the largest sampled RSS (a lower bound: no thread polls). GPU
(only once CUDA is initialised): `torch.cuda.max_memory_allocated/reserved`, whose peak
counters are reset at each stage start. Stages may nest (eval inside train): an inner stage's
reset first folds the peak so far into the outer stage, so the outer peak covers the inner.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

STAGES = ("init", "train", "eval", "save")
_MB = 2**20
# ru_maxrss is in kilobytes on Linux, in bytes on macOS.
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


@dataclass
class _Sample:
    rss: int
    maxrss: int
    gpu_alloc: int | None
    gpu_reserved: int | None


@dataclass
class _Open:
    maxrss_start: int
    cpu_peak: int
    gpu_alloc_peak: int | None = None
    gpu_reserved_peak: int | None = None

    def fold(self, s: _Sample) -> None:
        self.cpu_peak = max(self.cpu_peak, s.rss)
        if s.maxrss > self.maxrss_start:
            self.cpu_peak = max(self.cpu_peak, s.maxrss)
        if s.gpu_alloc is not None and s.gpu_reserved is not None:
            self.gpu_alloc_peak = max(self.gpu_alloc_peak or 0, s.gpu_alloc)
            self.gpu_reserved_peak = max(self.gpu_reserved_peak or 0, s.gpu_reserved)

    def merge(self, earlier: _Open) -> None:
        """Take in the peaks of an earlier run of the same stage."""
        self.fold(_Sample(earlier.cpu_peak, 0, earlier.gpu_alloc_peak, earlier.gpu_reserved_peak))


class StageMemory:
    """Peak memory of the stages init, train, eval, save; a stage run several times (eval,
    save) reports its largest peak.

    `start(stage)`/`stop(stage)` or `with mem.stage(stage):`; `metrics()` gives
    `<stage>_mem_cpu_peak_mb` and, when CUDA was used, `<stage>_mem_gpu_alloc_peak_mb` and
    `<stage>_mem_gpu_reserved_peak_mb`.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None
        self._process = psutil.Process()
        self._open: dict[str, _Open] = {}
        self._done: dict[str, _Open] = {}

    def _cuda(self) -> bool:
        # is_initialized() never initialises CUDA itself: a CPU run stays CUDA-free.
        return torch.cuda.is_initialized()

    def _sample(self) -> _Sample:
        rss = self._process.memory_info().rss
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT
        if not self._cuda():
            return _Sample(rss, maxrss, None, None)
        return _Sample(
            rss,
            maxrss,
            torch.cuda.max_memory_allocated(self.device),
            torch.cuda.max_memory_reserved(self.device),
        )

    def start(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown memory stage {stage!r}; known: {', '.join(STAGES)}")
        if stage in self._open:
            raise RuntimeError(f"memory stage {stage!r} started twice")
        s = self._sample()
        for outer in self._open.values():
            outer.fold(s)  # before the reset below wipes the outer stage's GPU peak
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
        self._open[stage] = _Open(maxrss_start=s.maxrss, cpu_peak=s.rss)

    def stop(self, stage: str) -> None:
        if stage not in self._open:
            raise RuntimeError(f"memory stage {stage!r} stopped but not started")
        s = self._sample()
        for running in self._open.values():
            running.fold(s)
        ended = self._open.pop(stage)
        if stage in self._done:
            ended.merge(self._done[stage])
        self._done[stage] = ended

    @contextmanager
    def stage(self, stage: str) -> Iterator[None]:
        self.start(stage)
        try:
            yield
        finally:
            self.stop(stage)

    def metrics(self) -> dict[str, float]:
        """Peaks in MB (2**20 bytes) of the stages that ended, in STAGES order."""
        out: dict[str, float] = {}
        for stage in STAGES:
            m = self._done.get(stage)
            if m is None:
                continue
            out[f"{stage}_mem_cpu_peak_mb"] = round(m.cpu_peak / _MB, 2)
            if m.gpu_alloc_peak is not None and m.gpu_reserved_peak is not None:
                out[f"{stage}_mem_gpu_alloc_peak_mb"] = round(m.gpu_alloc_peak / _MB, 2)
                out[f"{stage}_mem_gpu_reserved_peak_mb"] = round(m.gpu_reserved_peak / _MB, 2)
        return out


def speed_metrics(
    prefix: str,
    start_time: float,
    num_samples: int | None = None,
    num_steps: int | None = None,
    num_tokens: int | None = None,
    *,
    now: float | None = None,
) -> dict[str, float]:
    """`<prefix>_runtime` (s, since `start_time` from time.perf_counter()) and, for each count
    given, `<prefix>_{samples,steps,tokens}_per_second`, as Hugging Face's speed_metrics.

    `now` defaults to time.perf_counter(). A zero runtime gives the runtime alone.
    """
    runtime = (time.perf_counter() if now is None else now) - start_time
    result = {f"{prefix}_runtime": round(runtime, 4)}
    if runtime <= 0:
        return result
    for name, count in (("samples", num_samples), ("steps", num_steps), ("tokens", num_tokens)):
        if count is not None:
            result[f"{prefix}_{name}_per_second"] = round(count / runtime, 3)
    return result


def tiny_gpt_flops(n_params: int, n_layer: int, n_embd: int, seq_len: int, tokens: int) -> float:
    """Training FLOPs (forward + backward) for `tokens` tokens of a GPT, PaLM-style accounting
    (Chowdhery et al. 2022, appendix B; as nanoGPT's estimate_mfu):

        6 * n_params * tokens  +  12 * n_layer * n_embd * seq_len * tokens

    The first term is the matmuls with the weights (2 forward + 4 backward per parameter per
    token); the second is attention scores and values (QK^T, AV) over a context of seq_len,
    without halving for the causal mask. `n_params` should leave out the position embeddings.
    """
    for name, value in (
        ("n_params", n_params),
        ("n_layer", n_layer),
        ("n_embd", n_embd),
        ("seq_len", seq_len),
        ("tokens", tokens),
    ):
        if value < 0:
            raise ValueError(f"tiny_gpt_flops: {name} must be >= 0, got {value}")
    return float(6 * n_params * tokens + 12 * n_layer * n_embd * seq_len * tokens)
