"""The dependency direction launcher -> core -> checkpointing, and core's hands-off rules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {"checkpointing": {"core", "launcher"}, "core": {"launcher"}}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    for path in (REPO / package).rglob("*.py"):
        bad = imported_packages(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_core_reads_no_environment_and_handles_no_signals():
    for path in (REPO / "core").rglob("*.py"):
        text = path.read_text()
        for needle in ("os.environ", "os.getenv", "signal.signal("):
            assert needle not in text, f"{path.relative_to(REPO)} uses {needle}"


def test_models_import_no_torch_distributed():
    for path in (REPO / "core" / "models").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith("torch.distributed")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_glibc_malloc_tuning_respects_user_settings():
    from launcher.malloc import tune_glibc_malloc

    assert tune_glibc_malloc({"MALLOC_ARENA_MAX": "2"}) is False
    assert tune_glibc_malloc({}) is True  # this machine runs glibc
