"""podman for the deploy tests: the host made ready once (tests/deploy/podman_setup.py), the CPU
image built once per session, containers and networks named per test and removed after it.

conftest.py imports the fixtures: `podman_host`, `cpu_image`, `podman_run`.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy import podman_setup
from tests.deploy.podman_setup import Forbidden, Host

REPO = podman_setup.REPO
IMAGE_TAG = "localhost/resumable-trainer:cpu-test"
STOP_TIMEOUT_S = 150  # compose.yaml's stop_grace_period: PET_SHUTDOWN_TIMEOUT (120 s) + 30 s


def podman(host: Host, *args: str, timeout: float = 120, check: bool = True) -> str:
    """`podman ARGS` with the tests' containers.conf; stdout (stderr joined into an error)."""
    result = subprocess.run(
        ["podman", *args], env=host.env(), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stderr}")
    return result.stdout


def build_command(host: Host, tag: str, context: Path = REPO) -> list[str]:
    """The CPU image from this checkout: base image from podman_setup, every wheel from its
    wheelhouse (offline), the host's CA bundle a build secret."""
    dockerfile = context / "docker" / "Dockerfile.cpu"
    cmd = ["podman", "build", "--pull=never", "-f", str(dockerfile), "-t", tag]
    cmd += ["-v", f"{host.wheels}:/wheels:ro"]
    cmd += ["--build-arg", "PIP_FIND_LINKS=/wheels", "--build-arg", "PIP_NO_INDEX=1"]
    if host.ca_bundle is not None:
        cmd += ["--secret", f"id=pip_ca,src={host.ca_bundle}"]
    return [*cmd, str(context)]


def build_image(host: Host, tag: str = IMAGE_TAG, context: Path = REPO) -> float:
    """Build (layers cached by podman between sessions); the seconds it took."""
    start = time.monotonic()
    result = subprocess.run(
        build_command(host, tag, context),
        env=host.env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return time.monotonic() - start


@dataclass
class Container:
    """One container started by a test (detached); its name is unique to the session."""

    host: Host
    name: str

    def exit_code(self) -> int:
        return int(podman(self.host, "inspect", "--format", "{{.State.ExitCode}}", self.name))

    def running(self) -> bool:
        state = podman(self.host, "inspect", "--format", "{{.State.Status}}", self.name)
        return state.strip() == "running"

    def wait(self, timeout: float = 600) -> int:
        """The exit code, once the container has stopped."""
        out = podman(self.host, "wait", self.name, timeout=timeout)
        return int(out.strip().splitlines()[-1])

    def start(self) -> None:
        """`podman start`: the same container, same command, again."""
        podman(self.host, "start", self.name)

    def logs(self) -> str:
        result = subprocess.run(
            ["podman", "logs", self.name],
            env=self.host.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout + result.stderr


@dataclass
class Runner:
    """Starts containers of the session's image; removes them, and networks, at teardown."""

    host: Host
    image: str
    prefix: str
    containers: list[Container] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)

    def network(self) -> str:
        name = f"{self.prefix}-net{len(self.networks)}"
        podman(self.host, "network", "create", name)
        self.networks.append(name)
        return name

    def run(
        self,
        name: str,
        volume: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        options: list[str] | None = None,
    ) -> Container:
        """`podman run -d -v VOLUME:/runs ... IMAGE ARGS` (ARGS go to the launcher)."""
        container = Container(self.host, f"{self.prefix}-{len(self.containers)}-{name}")
        cmd = ["run", "-d", "--name", container.name, "-v", f"{volume}:/runs"]
        cmd += ["--stop-timeout", str(STOP_TIMEOUT_S), "--shm-size", "1g"]
        # one thread per worker in every run: a test's runs then compute alike whatever ran beside
        for key, value in {"OMP_NUM_THREADS": "1", **(env or {})}.items():
            cmd += ["-e", f"{key}={value}"]
        self.containers.append(container)
        podman(self.host, *cmd, *(options or []), self.image, *args)
        return container

    def close(self) -> None:
        for c in self.containers:
            podman(self.host, "rm", "--force", "--time", "0", c.name, check=False)
        for n in self.networks:
            podman(self.host, "network", "rm", "--force", n, check=False)


def runs_volume(path: Path, uid: int = 10001) -> Path:
    """A host directory for /runs, owned by the image's user (as a named volume would be)."""
    path.mkdir(parents=True)
    os.chown(path, uid, uid)
    return path


def wait_for_lines(path: Path, count: int, container: Container, timeout: float = 300) -> None:
    """Until `path` (a metrics.jsonl) has `count` lines; fails if the container ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= count:
            return
        if not container.running():
            raise AssertionError(f"{container.name} ended first:\n{container.logs()}")
        time.sleep(0.2)
    raise TimeoutError(f"{path} has fewer than {count} lines after {timeout} s")


@pytest.fixture(scope="session")
def podman_host() -> Host:
    """This host made ready for podman, or the test skipped: containers cannot run here."""
    start = time.monotonic()
    try:
        host = podman_setup.setup()
    except Forbidden as e:
        pytest.skip(f"containers cannot run here: {e}")
    print(f"\n[podman] host ready in {time.monotonic() - start:.1f} s")
    return host


@pytest.fixture(scope="session")
def cpu_image(podman_host: Host) -> str:
    """docker/Dockerfile.cpu built from this checkout, once per session."""
    seconds = build_image(podman_host)
    size = podman(podman_host, "image", "inspect", "--format", "{{.Size}}", IMAGE_TAG)
    print(f"\n[podman] image {IMAGE_TAG} built in {seconds:.0f} s, {int(size) / 1e9:.2f} GB")
    return IMAGE_TAG


@pytest.fixture(scope="module")
def podman_run(podman_host: Host, cpu_image: str) -> Iterator[Runner]:
    """Starts containers of the CPU image; removes them (and networks) after the module."""
    runner = Runner(podman_host, cpu_image, f"rt-{uuid.uuid4().hex[:8]}")
    try:
        yield runner
    finally:
        runner.close()
