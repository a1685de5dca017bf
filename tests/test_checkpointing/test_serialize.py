"""Round trips through checkpointing.serialize: bit-exact, pickle-free, digests as written."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import blake3
import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from checkpointing.digest import digest_file, digest_stream
from checkpointing.serialize import (
    FileDigest,
    StateFormatError,
    decode,
    encode,
    fsync_dir,
    load_state,
    read_json,
    save_state,
    write_json,
    write_safetensors,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b, path="root"):
    """Deep equality: tensors bit-equal with the same dtype/shape, containers of the same type."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        # Compare bits, not values: NaN payloads must survive too.
        assert torch.equal(bits(a), bits(b)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def sort(tensors: dict) -> dict:
    return dict(sorted(tensors.items()))


def digest_of(path: Path) -> FileDigest:
    data = path.read_bytes()
    return FileDigest(len(data), blake3.blake3(data).hexdigest(), "blake3")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def adamw_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def test_adamw_round_trip_and_resume_bit_exact(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for s in range(2):
        adamw_step(model, opt, s)
    save_state(tmp_path, "model", model.state_dict())
    digests = save_state(tmp_path, "optimizer", opt.state_dict())
    assert set(digests) == {"optimizer.json", "optimizer.safetensors"}

    loaded = load_state(tmp_path, "optimizer")
    assert_same(opt.state_dict(), loaded)
    assert isinstance(loaded["param_groups"][0]["betas"], tuple)
    assert all(isinstance(k, int) for k in loaded["state"])

    resumed = make_model()
    resumed.load_state_dict(load_state(tmp_path, "model"))
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1.0)
    resumed_opt.load_state_dict(loaded)
    adamw_step(model, opt, 2)
    adamw_step(resumed, resumed_opt, 2)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tied_weights_stored_once(tmp_path):
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    state = {"wte.weight": emb.weight, "lm_head.weight": head.weight, "other": torch.ones(3)}
    _, tensors = encode(state)
    assert len(tensors) == 2
    save_state(tmp_path, "model", state)
    on_disk = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert sorted(on_disk) == ["other", "wte.weight"]
    loaded = load_state(tmp_path, "model")
    assert torch.equal(loaded["wte.weight"], emb.weight.detach())
    assert loaded["lm_head.weight"] is loaded["wte.weight"]


def test_overlapping_views_get_own_copy(tmp_path):
    base = torch.arange(10.0)
    state = [base[0:6], base[4:10], base[0:6], base.view(2, 5)[:, 0], base[6:8]]
    structure, tensors = encode(state)
    assert sorted(tensors) == ["0", "1", "3", "4"]  # only the identical view base[0:6] is merged
    storage = base.untyped_storage().data_ptr()
    assert tensors["0"].untyped_storage().data_ptr() == storage  # no needless copies
    assert tensors["1"].untyped_storage().data_ptr() != storage  # overlaps "0": cloned
    assert tensors["4"].untyped_storage().data_ptr() == storage  # disjoint from "0": kept
    safetensors.torch.save_file(tensors, tmp_path / "ok.safetensors")  # nothing it would refuse
    assert_same(decode(structure, tensors), state)


def test_scheduler_like_dict_with_inf_nan(tmp_path):
    state = {
        "best": math.inf,
        "worst": -math.inf,
        "last": math.nan,
        "neg_zero": -0.0,
        "base_lrs": [0.1, 1e-300],
        "_last_lr": [5e-324],
        "mode": "min",
        "verbose": False,
        "lr_lambdas": [None],
        "big": 2**80,
    }
    assert save_state(tmp_path, "scheduler", state).keys() == {"scheduler.json"}
    loaded = load_state(tmp_path, "scheduler")
    assert_same(state, loaded)
    assert math.copysign(1.0, loaded["neg_zero"]) == -1.0


def test_nested_tuples_int_keys_and_marker_keys():
    state = {
        "a": ((1, (2.5, None)), [True, ()]),
        "ids": {0: "x", 1: {2: (3,)}, -7: [], (1, "k"): "tuple key", None: 0, 1.5: "f"},
        "escape": {"__tensor__": "not a ref", "__tuple__": [1]},
        "t": (torch.tensor(3), {"__dict__": torch.zeros(2, dtype=torch.bool)}),
        "a.b": torch.ones(1),
        "": {"b": torch.zeros(1)},
    }
    structure, tensors = encode(state)
    assert len(tensors) == len(set(tensors)) == 4
    structure = json.loads(json.dumps(structure))  # what goes through the file
    assert_same(state, decode(structure, tensors))


def test_rejects_unsupported_types():
    with pytest.raises(TypeError, match="set at x"):
        encode({"x": {1, 2}})


DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(shape))
    raw = torch.randint(0, 256, (*shape, torch.empty((), dtype=dtype).element_size()), generator=g)
    if dtype == torch.bool:
        return raw[..., 0].remainder(2).bool()
    return raw.to(torch.uint8).view(dtype).reshape(shape)  # arbitrary bits, incl. NaN payloads


def test_dtype_matrix_readable_by_safetensors(tmp_path):
    tensors = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}.matrix"] = sample(dtype, (3, 5))
        tensors[f"{name}.scalar"] = sample(dtype, ())
        tensors[f"{name}.empty"] = sample(dtype, (0, 4))
        tensors[f"{name}.strided"] = sample(dtype, (4, 6)).t()[1:, ::2]
    path = tmp_path / "m.safetensors"
    digest = write_safetensors(path, tensors, {"format": "pt"})
    assert digest == digest_of(path)
    assert_same(sort(tensors), sort(safetensors.torch.load_file(path)))
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k in tensors:
            assert_same(tensors[k], f.get_tensor(k), k)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_chunked_write_matches(tmp_path, monkeypatch):
    monkeypatch.setattr("checkpointing.serialize._CHUNK", 64)
    tensors = {"a": torch.randn(1000), "b": torch.randn(7, 9).t(), "c": torch.arange(3)}
    digest = write_safetensors(tmp_path / "c.safetensors", tensors)
    assert digest == digest_of(tmp_path / "c.safetensors")
    assert_same(sort(tensors), sort(safetensors.torch.load_file(tmp_path / "c.safetensors")))


def test_digests_match_files(tmp_path):
    state = {"w": torch.randn(4, 4), "n": 3}
    digests = save_state(tmp_path, "rng/rank-00001", state)
    assert set(digests) == {"rng/rank-00001.json", "rng/rank-00001.safetensors"}
    for rel, digest in digests.items():
        assert digest == digest_of(tmp_path / rel)
    assert_same(state, load_state(tmp_path, "rng/rank-00001"))
    obj = {"x": [1, 2.5, "é"]}
    assert write_json(tmp_path / "o.json", obj) == digest_of(tmp_path / "o.json")
    assert read_json(tmp_path / "o.json") == obj
    fsync_dir(tmp_path)


@pytest.mark.parametrize("name", ["a/b/c", "../x", "", "a//b", "/abs"])
def test_bad_names_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="state name"):
        save_state(tmp_path, name, {})


class _Plant:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_planted_pickle_does_not_execute(tmp_path):
    save_state(tmp_path, "model", {"w": torch.ones(2)})
    pickle.loads(pickle.dumps(_Plant(tmp_path / "control")))  # the payload is live
    assert (tmp_path / "control").exists()
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Plant(marker))
    (tmp_path / "model.safetensors").write_bytes(payload)
    with pytest.raises(StateFormatError, match="model.safetensors"):
        load_state(tmp_path, "model")
    (tmp_path / "model.json").write_bytes(payload)
    with pytest.raises(StateFormatError, match="model.json"):
        load_state(tmp_path, "model")
    assert not marker.exists()


def test_truncated_safetensors(tmp_path):
    save_state(tmp_path, "model", {"w": torch.randn(64)})
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(StateFormatError, match=r"model\.safetensors"):
        load_state(tmp_path, "model")


def test_missing_tensor_reference(tmp_path):
    save_state(tmp_path, "s", {"w": torch.ones(1)})
    os.unlink(tmp_path / "s.safetensors")
    with pytest.raises(StateFormatError, match=r"s\.json"):
        load_state(tmp_path, "s")


@pytest.mark.parametrize("size", [0, 1, 1024, (16 << 20) + 3])
def test_file_digest_is_the_stream_digest(tmp_path, size):
    """A local file verifies through a mapping (BLAKE3 on every core); the digest is the one a
    stream read gives, for an empty file and one of more than a read chunk too."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(size))
    for algorithm in ("blake3", "sha256"):
        with path.open("rb") as f:
            assert digest_file(path, algorithm) == digest_stream(f, algorithm)
    assert digest_file(path) == (size, blake3.blake3(path.read_bytes()).hexdigest())
