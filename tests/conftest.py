"""Shared fixtures. The autouse guard fails a test that leaks env vars, a process group or threads
(in the spirit of Lightning's tests_fabric/conftest.py)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
# Set by pytest itself, or by torch on first use of its compiler stack: not a test's leak.
ENV_ALLOWED = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
# The longest test files, longest first (each 1.5 to 6 minutes on 2 cores; the others take less
# than 2): collected first, they are the first files pytest-xdist hands its workers (`make test`
# keeps the collection's order: --no-loadscope-reorder), so the workers end together instead of
# one running a long file alone at the end, as by xdist's own order (most tests first).
LONGEST_FIRST = (
    "tests/test_core/engines/test_deepspeed.py",
    "tests/test_checkpointing/test_object_store.py",
    "tests/test_hf_distributed.py",
    "tests/test_bench/test_bench.py",
    "tests/test_core/engines/test_fsdp.py",
    "tests/test_elastic.py",
    "tests/test_resume.py",
    "tests/test_interruptions.py",
    "tests/test_core/data/test_store_distributed.py",
    "tests/test_checkpointing/test_lease.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """LONGEST_FIRST's files first; every file's tests stay together and in their order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def no_leaks():
    env_before = dict(os.environ)
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    leaked_env = {
        k
        for k in set(os.environ) | set(env_before)
        if os.environ.get(k) != env_before.get(k) and k not in ENV_ALLOWED
    }
    os.environ.clear()
    os.environ.update(env_before)
    assert not leaked_env, f"test leaked environment variables: {sorted(leaked_env)}"
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test leaked an initialised process group")
    leaked = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and t.is_alive() and not t.daemon
    ]
    assert not leaked, f"test leaked threads: {[t.name for t in leaked]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def hub_offline():
    """Nothing downloads: the Hugging Face Hub client is offline for every in-process test
    (subprocesses get HF_HUB_OFFLINE=1 from tests/launch.py:child_env)."""
    try:
        import huggingface_hub.constants as hub
    except ImportError:
        yield
        return
    before, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    yield
    hub.HF_HUB_OFFLINE = before


@pytest.fixture(scope="session", autouse=True)
def sync_hf_loading():
    """transformers loads weights on a thread pool it shuts down without waiting: its threads
    may outlive a test by a moment, which the leak check would report. Every test (and every
    subprocess it starts) loads synchronously; set before any test, so no test's change."""
    before = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    yield
    if before is None:
        del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
    else:
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = before


@pytest.fixture(scope="session")
def hf_assets(tmp_path_factory):
    """Tiny Llama / GPT-2 model directories, a trained BPE tokenizer, text and chat data."""
    pytest.importorskip("transformers")
    from tests.hf_assets import make_assets

    return make_assets(tmp_path_factory.mktemp("hf_assets"))
