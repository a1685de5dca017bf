"""The storage layer and the object-store commit protocol, in one process: local paths and
fsspec's memory:// filesystem (object-store semantics: no rename, the manifest is the commit)."""

from __future__ import annotations

import logging

import pytest
import torch

from checkpointing.balanced import Balanced
from checkpointing.manager import CheckpointManager, Entry
from checkpointing.manifest import CheckpointCorruptError, list_committed, verify
from checkpointing.redact import REDACTED, redact_options
from checkpointing.retry import StorageError, retrying
from checkpointing.serialize import load_state
from checkpointing.staging import updated_by_step
from checkpointing.storage import FsspecStorage, LocalStorage, open_storage
from core.callbacks import TrainerCallback
from core.config import ConfigError, load_config
from core.engines.named_state import OptimizerState
from core.loop import DistInfo
from core.plan import open_checkpoint_storage
from core.run import build_trainer
from launcher.status import run_status
from tests.checkpoints import Weights, assert_tensors_equal, load_entry, memory_url
from tests.launch import SMALL


def save(manager: CheckpointManager, step: int, weights: Weights, background: bool = False):
    return manager.save(
        step, {"w": Entry(weights)}, {}, "fp", checks={}, rank_checks={}, background=background
    )


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_write_read_and_digest(tmp_path, kind):
    storage = open_storage(tmp_path / "s" if kind == "local" else memory_url())
    digest = storage.write_bytes("a/b.bin", b"payload" * 1000)
    assert digest.size == 7000 and storage.size("a/b.bin") == 7000
    assert storage.read_bytes("a/b.bin") == b"payload" * 1000
    assert storage.listdir() == ["a"] and storage.files() == ["a/b.bin"]
    assert isinstance(storage, LocalStorage if kind == "local" else FsspecStorage)
    storage.remove("a")
    assert not storage.exists("a/b.bin") and storage.listdir() == []


def test_retrying_recovers_from_transient_errors_and_gives_up_with_one_line():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return "ok"

    assert retrying("writing x", flaky, retries=3, backoff=0.001) == "ok" and len(calls) == 3
    with pytest.raises(StorageError, match=r"^writing y: failed after 2 attempts: .*reset"):
        retrying("writing y", lambda: (_ for _ in ()).throw(TimeoutError("reset")), 1, 0.001)
    with pytest.raises(FileNotFoundError):  # not transient: raised at once
        retrying("reading z", lambda: open("/nonexistent/z"), retries=5, backoff=10)


def test_credentials_are_redacted_and_public_options_kept():
    options = {
        "key": "AKIA",
        "secret": "s3cr3t",
        "token": "tok",
        "endpoint_url": "http://user:pw@127.0.0.1:9000",
        "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": "x"},
    }
    assert redact_options(options) == {
        "key": REDACTED,
        "secret": REDACTED,
        "token": REDACTED,
        "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": REDACTED},
    }


def test_object_store_commit_protocol(monkeypatch):
    """Objects first, manifest last; listing finds only committed checkpoints; retention
    deletes the manifest before the objects; leftovers without a manifest are cleaned."""
    url = memory_url()
    manager = CheckpointManager(open_storage(url), save_total_limit=2)
    weights = Weights(torch.arange(10.0))
    for step in (1, 2, 3):
        weights.t = weights.t + 1
        save(manager, step, weights)
    storage = manager.storage
    assert [s for s, _ in list_committed(storage)] == [3, 2]
    assert not storage.exists("checkpoint-1")  # retention left nothing of it behind
    # A save killed mid-upload: objects without a manifest are not a checkpoint...
    storage.write_bytes("checkpoint-4/w.json", b"{}")
    assert [s for s, _ in list_committed(storage)] == [3, 2]
    found, manifest = manager.resolve("latest")
    assert manifest.step == 3
    restored = Weights(torch.zeros(10))
    manager.load(found, manifest, {"w": Entry(restored)})
    assert torch.equal(restored.t, torch.arange(10.0) + 3)
    manager.clean_leftovers()  # ...and the next start removes them
    assert not storage.exists("checkpoint-4")

    removed = []
    remove = FsspecStorage.remove
    monkeypatch.setattr(
        FsspecStorage, "remove", lambda self, rel: (removed.append(self._p(rel)), remove(self, rel))
    )
    manager.housekeeping.delete_once("checkpoint-2")
    assert [p.rsplit("/run/", 1)[1] for p in removed] == [
        "checkpoint-2/manifest.json",
        "checkpoint-2",
    ]
    # A run resumed from an older checkpoint saves over a committed one of the abandoned
    # branch: that one's manifest goes first, then its objects, then the new save commits.
    removed.clear()
    save(manager, 3, Weights(torch.full((10,), -1.0)))
    assert [p.rsplit("/run/", 1)[1] for p in removed][:2] == [
        "checkpoint-3/manifest.json",
        "checkpoint-3",
    ]
    assert torch.equal(load_entry(storage.child("checkpoint-3"), "w")["w"], torch.full((10,), -1.0))


def test_a_corrupt_object_is_skipped_by_latest():
    manager = CheckpointManager(open_storage(memory_url()))
    for step in (1, 2):
        save(manager, step, Weights(torch.full((4,), float(step))))
    storage = manager.storage
    storage.write_bytes(
        "checkpoint-2/w.safetensors", b"x" * storage.size("checkpoint-2/w.safetensors")
    )
    with pytest.raises(CheckpointCorruptError, match="blake3 differs"):
        verify(storage.child("checkpoint-2"))
    _, manifest = manager.resolve("latest")
    assert manifest.step == 1


def test_background_save_writes_the_state_as_it_was_when_staged(tmp_path):
    """The loop changes the weights right after an async save returns: the checkpoint holds
    the values of the save's step, bit for bit (the staging copy), and equals a sync save."""
    big = torch.randn(4_000_000)
    expected = big.clone()
    async_mgr = CheckpointManager(tmp_path / "async", async_save=True)
    sync_mgr = CheckpointManager(tmp_path / "sync")
    weights = Weights(big)
    assert save(async_mgr, 1, weights, background=True) == []  # staged, not yet committed
    assert async_mgr.in_flight() == 1
    big.add_(1.0)  # training goes on, in place
    (outcome,) = async_mgr.wait()
    assert outcome.error is None and outcome.location.endswith("checkpoint-1")
    assert torch.equal(load_state(tmp_path / "async" / "checkpoint-1", "w")["w"], expected)
    big.copy_(expected)
    save(sync_mgr, 1, weights)
    for rel in ("w.safetensors", "w.json"):
        a = (tmp_path / "async" / "checkpoint-1" / rel).read_bytes()
        assert a == (tmp_path / "sync" / "checkpoint-1" / rel).read_bytes(), rel


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_an_async_save_reports_the_bytes_it_holds(tmp_path, caplog, layout):
    """A view of live memory is copied into a staging buffer, a transposed tensor (like a GPU
    tensor) into a private copy when it is encoded: the log counts both (the copy was missed)."""
    big = torch.randn(1000, 1000)
    weights = Weights(big if layout == "contiguous" else big.t())
    manager = CheckpointManager(tmp_path / "run", async_save=True)
    with caplog.at_level(logging.INFO, logger="checkpointing.manager"):
        save(manager, 1, weights, background=True)
        manager.wait()
    assert "(4.0 MB held for the writer)" in caplog.text, caplog.text


def test_staging_buffers_are_allocated_once_and_reused(tmp_path):
    """The second async save copies into the buffers the first one allocated (no new memory,
    no page faults), and writes its own step's values."""
    big = torch.randn(1_000_000)
    manager = CheckpointManager(tmp_path, async_save=True)
    weights = Weights(big)
    save(manager, 1, weights, background=True)
    first = {k: b.data_ptr() for k, b in manager._staging._buffers.items()}
    big.add_(1.0)
    save(manager, 2, weights, background=True)
    manager.wait()
    assert {k: b.data_ptr() for k, b in manager._staging._buffers.items()} == first
    assert torch.equal(load_state(tmp_path / "checkpoint-2", "w")["w"], big)


def test_what_only_an_optimizer_step_changes():
    """The storages an async save may copy on a side stream (they change only in an optimizer
    step): every engine entry's parameters and optimizer state, found through the wrappers the
    engines use; not a buffer a forward updates in place, not the schedule's values."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    entries = {
        "model": Balanced(model, 0, 1),
        "optimizer": Balanced(OptimizerState(model, opt), 0, 1),
        "scheduler": schedule,
    }
    found = updated_by_step(entries.values())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values()}
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    assert params | state <= found
    assert not buffers & found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_async_save_holds_the_state_of_its_step(tmp_path):
    """On a GPU: pinned buffers, side-stream copies; training goes on at once (forward, backward
    and optimizer steps change every parameter and moment in place), and the checkpoint still
    holds the values of the step it was staged at, bit for bit. Runs on a CUDA machine only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512)).cuda()
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(torch.randn(64, 512, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def snapshot() -> dict:
        return {
            "model": {k: v.cpu().clone() for k, v in model.state_dict().items()},
            "optimizer": {
                i: {k: v.cpu().clone() for k, v in s.items()}
                for i, s in opt.state_dict()["state"].items()
            },
        }

    step()
    entries = {"model": Entry(model), "optimizer": Entry(OptimizerState(model, opt))}
    manager = CheckpointManager(tmp_path, async_save=True)
    for rep in (1, 2):  # the second save reuses the pinned buffers
        expected = snapshot()
        manager.save(rep, entries, {}, "fp", checks={}, rank_checks={}, background=True)
        for _ in range(3):
            step()
        manager.wait()
        pinned = [b.is_pinned() for (f, _), b in manager._staging._buffers.items() if f == "model"]
        assert pinned and all(pinned)  # every model tensor is on the GPU
        model_state = load_state(tmp_path / f"checkpoint-{rep}", "model")
        assert_tensors_equal(model_state, expected["model"])
        saved = load_state(tmp_path / f"checkpoint-{rep}", "optimizer")["state"]
        for i, moments in expected["optimizer"].items():
            assert_tensors_equal(saved[i], moments)


def test_at_most_one_save_in_flight(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, async_save=True)
    weights = Weights(torch.randn(2_000_000))
    save(manager, 1, weights, background=True)
    with caplog.at_level("INFO", logger="checkpointing.manager"):
        done = save(manager, 2, weights, background=True)
    assert [o.step for o in done] == [1]  # the first committed before the second was staged
    assert "waiting for checkpoint-1" in caplog.text
    assert [o.step for o in manager.wait()] == [2]


def run_config(tmp_path, *extra: str):
    return load_config(
        None,
        [*SMALL, "--run.output_dir", str(tmp_path / "run"), "--train.max_steps", "12", *extra],
    )


class StopAt(TrainerCallback):
    """Stops training at a step (a clean, checkpointed stop)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, config, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_exact_resume_from_memory_store(tmp_path):
    """memory:// lives in this process: train to a stop, then a new trainer resumes from the
    store and ends with the weights of an uninterrupted run (torch.equal)."""
    ref = build_trainer(run_config(tmp_path / "ref"), DistInfo(), torch.device("cpu"))
    ref.train()
    url = memory_url()
    config = run_config(tmp_path, "--checkpoint.dir", url, "--checkpoint.async_save", "true")
    first = build_trainer(config, DistInfo(), torch.device("cpu"), callbacks=[StopAt(5)])
    assert first.train().global_step == 5
    second = build_trainer(config, DistInfo(), torch.device("cpu"))
    assert second.train().global_step == 12
    storage = open_storage(url)
    assert list_committed(storage)[0][0] == 12
    for name in ("model", "optimizer"):
        assert_tensors_equal(
            load_entry(tmp_path / "ref" / "run" / "checkpoint-12", name),
            load_entry(storage.child("checkpoint-12"), name),
            name,
        )
    assert not (tmp_path / "run" / "checkpoint-12").exists()


def test_memory_store_is_refused_for_several_ranks(tmp_path):
    config = run_config(tmp_path, "--checkpoint.dir", memory_url())
    with pytest.raises(ConfigError, match="checkpoint.dir: .* one process's memory"):
        open_checkpoint_storage(config, world_size=2)


def test_status_finds_checkpoints_in_checkpoint_dir(tmp_path):
    config = run_config(tmp_path, "--checkpoint.dir", str(tmp_path / "elsewhere"))
    build_trainer(config, DistInfo(), torch.device("cpu")).train()
    (tmp_path / "run" / "config.yaml").write_text(
        f"checkpoint:\n  dir: {tmp_path / 'elsewhere'}\n  storage_options: {{}}\n"
    )
    status = run_status(tmp_path / "run")
    assert status.last_checkpoint == "checkpoint-12" and status.checkpoints == 1
