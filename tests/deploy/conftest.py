"""Fixtures of the deploy tests, each kept in the module of what it deploys on. Every test here
is the second stage (`make test-deploy`, `-m deploy`): marked so, whatever its module says."""

import pytest

from tests.deploy.podman import cpu_image, podman_host, podman_run  # noqa: F401
from tests.deploy.slurm import slurm_cluster  # noqa: F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/deploy/" in item.nodeid:
            item.add_marker(pytest.mark.deploy)
