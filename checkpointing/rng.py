"""Every RNG stream of one process as a Stateful: Python, NumPy's global generator, torch CPU,
and each CUDA device's generator when CUDA is in use.

accelerate restores some of these and only on some branches (and silently skips on error);
here one function pair captures and restores all of them, tested as a round trip. The state is
plain JSON (base64 for byte states) so it is saved without pickle.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())


class RNGState:
    """Stateful over this process's global generators.

    `extra` holds plain values that seeded other generators (e.g. the DataLoader worker-seed
    inputs), saved beside the states and checked by whoever restores them.
    """

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self.extra = dict(extra or {})

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss_next": gauss},
            "numpy": {
                "kind": kind,
                "keys": base64.b64encode(np.ascontiguousarray(keys).tobytes()).decode(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch_cpu": _b64(torch.get_rng_state()),
            "cuda": [],
            "extra": self.extra,
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        npy = state["numpy"]
        keys = np.frombuffer(base64.b64decode(npy["keys"]), dtype=np.uint32).copy()
        np.random.set_state(
            (npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
        )
        torch.set_rng_state(_unb64(state["torch_cpu"]))
        saved_cuda = state["cuda"]
        if saved_cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() < len(saved_cuda):
                raise RuntimeError(
                    f"the checkpoint holds {len(saved_cuda)} CUDA generator states but "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                    "CUDA devices are visible; resume on the same kind of machine"
                )
            torch.cuda.set_rng_state_all([_unb64(s) for s in saved_cuda])
        self.extra = dict(state.get("extra", {}))


def rng_fingerprint(state: dict[str, Any]) -> str:
    """A short digest of an RNGState.state_dict(), for the self-check after a resume."""
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
