"""docker/Dockerfile.cpu built by podman (tests/deploy/podman.py: once per session, from a base
image debootstrapped from Debian's archive) and run as a user runs it: `podman run` with a /runs
volume, `podman stop` mid-run, `podman start` again, two containers laid out as
docker/examples/compose.yaml. Every interrupted run must end bit-identical to an uninterrupted
one: the same loss at every step, the same weights and optimizer state (torch.equal).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from checkpointing.manifest import list_checkpoints
from tests.checkpoints import assert_same_checkpoint, assert_same_losses
from tests.deploy.podman import (
    STOP_TIMEOUT_S,
    Container,
    Runner,
    build_image,
    podman,
    runs_volume,
    wait_for_lines,
)
from tests.launch import read_metrics

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "examples" / "compose.yaml"
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
# The image's CMD writes to runs/tiny, i.e. /runs/tiny in the volume.
DEFAULT_RUN = Path(TINY["run"]["output_dir"]).name
PREEMPTED = 75
USAGE = 2


def timed(what: str, start: float) -> None:
    print(f"\n[podman] {what}: {time.monotonic() - start:.1f} s")


def last_checkpoint(run_dir: Path) -> Path:
    (_, name), *_ = list_checkpoints(run_dir)  # the newest
    return run_dir / name


def finish(container: Container, what: str) -> int:
    start = time.monotonic()
    code = container.wait()
    timed(f"{what} ended with {code}", start)
    return code


def stop_and_resume(containers: list[Container], metrics: Path, lines: int, steps: int) -> int:
    """Once `metrics` has `lines` lines: `podman stop` every container at once (as `docker
    compose stop` does), check each exited 75, `podman start` them again (the first first: it
    hosts the rendezvous). Returns the step of the checkpoint the stop committed."""
    wait_for_lines(metrics, lines, containers[0])
    start = time.monotonic()
    names = [c.name for c in containers]
    podman(containers[0].host, "stop", "--time", str(STOP_TIMEOUT_S), *names, timeout=300)
    timed(f"podman stop of {len(containers)} container(s)", start)
    for c in containers:
        assert c.exit_code() == PREEMPTED, c.logs()
        assert "checkpoint committed" in c.logs(), c.logs()
    step = int(last_checkpoint(metrics.parent).name.split("-")[1])
    assert step < steps, "the run ended before the stop: nothing was tested"
    for c in containers:
        c.start()
    return step


@pytest.fixture(scope="module")
def default_run(podman_run: Runner, tmp_path_factory) -> Path:
    """The image's default command (`podman run -v DIR:/runs IMAGE`, no arguments), to the end."""
    volume = runs_volume(tmp_path_factory.mktemp("default") / "runs")
    start = time.monotonic()
    container = podman_run.run("default", volume, [])
    code = container.wait()
    timed("default command, uninterrupted", start)
    assert code == 0, container.logs()
    return volume / DEFAULT_RUN


def test_default_command_trains_and_exits_0(default_run: Path) -> None:
    steps = [r["step"] for r in read_metrics(default_run)]
    assert steps[-1] == TINY["train"]["max_steps"]
    assert (default_run / f"checkpoint-{steps[-1]}" / "manifest.json").is_file()


def test_stop_exits_75_and_start_continues_bit_identical(
    podman_run: Runner, default_run: Path, tmp_path: Path
) -> None:
    """The default command, stopped by `podman stop` after 3 metrics lines (SIGTERM: every rank
    commits a checkpoint at the step it reached, the agent exits 75), then `podman start`ed:
    the same container resumes and ends equal to the uninterrupted default run."""
    volume = runs_volume(tmp_path / "runs")
    run_dir = volume / DEFAULT_RUN
    start = time.monotonic()
    container = podman_run.run("stopped", volume, [])
    step = stop_and_resume([container], run_dir / "metrics.jsonl", 3, TINY["train"]["max_steps"])
    assert finish(container, "restarted container") == 0, container.logs()
    timed(f"stopped at step {step} and resumed to the end", start)
    assert f"{DEFAULT_RUN}/checkpoint-{step} at step {step}" in container.logs()  # resumed from
    assert_same_losses(run_dir, default_run)
    assert_same_checkpoint(last_checkpoint(run_dir), last_checkpoint(default_run))


def compose_nodes(runner: Runner, volume: Path, extra: list[str]) -> list[Container]:
    """docker/examples/compose.yaml's two services as two containers of one podman network:
    hostnames, network aliases, PET_* environment and command as the file gives them (the
    command lengthened by `extra`), both nodes on one /runs volume."""
    spec = yaml.safe_load(COMPOSE.read_text())
    network = runner.network()
    nodes = []
    for name, svc in spec["services"].items():
        hostname = svc["hostname"]
        options = ["--network", network, "--network-alias", hostname, "--hostname", hostname]
        env = {k: str(v) for k, v in svc["environment"].items()}
        nodes.append(runner.run(name, volume, [*svc["command"], *extra], env, options))
    return nodes


def compose_output(volume: Path) -> Path:
    command = next(iter(yaml.safe_load(COMPOSE.read_text())["services"].values()))["command"]
    output = command[command.index("--run.output_dir") + 1]
    return volume / Path(output).relative_to("/runs")


COMPOSE_STEPS = 120
COMPOSE_SHORT = [
    "--train.max_steps", str(COMPOSE_STEPS),
    "--data.max_bytes", "200000",
    "--train.logging_steps", "1",
    "--checkpoint.save_steps", "1000",  # only the checkpoint the stop asks for, and the last
]  # fmt: skip


def test_two_compose_nodes_stopped_and_started_end_bit_identical(
    podman_run: Runner, tmp_path: Path
) -> None:
    reference_volume = runs_volume(tmp_path / "reference")
    start = time.monotonic()
    reference = compose_nodes(podman_run, reference_volume, COMPOSE_SHORT)
    for node in reference:
        assert node.wait() == 0, node.logs()
    timed("two nodes, uninterrupted", start)
    reference_dir = compose_output(reference_volume)
    manifest = json.loads((last_checkpoint(reference_dir) / "manifest.json").read_text())
    assert manifest["world_size"] == 2

    volume = runs_volume(tmp_path / "stopped")
    start = time.monotonic()
    nodes = compose_nodes(podman_run, volume, COMPOSE_SHORT)
    run_dir = compose_output(volume)
    step = stop_and_resume(nodes, run_dir / "metrics.jsonl", 5, COMPOSE_STEPS)
    for node in nodes:
        assert finish(node, f"restarted {node.name}") == 0, node.logs()
    timed(f"two nodes stopped at step {step} and resumed to the end", start)
    assert read_metrics(run_dir)[-1]["step"] == COMPOSE_STEPS
    assert_same_losses(run_dir, reference_dir)
    assert_same_checkpoint(last_checkpoint(run_dir), last_checkpoint(reference_dir))


def test_unwritable_volume_exits_2_naming_the_fix(podman_run: Runner, tmp_path: Path) -> None:
    """/runs a host directory of root's (mode 0755), the container uid 10001: exit 2 before any
    work, one line naming the directory, the uid and the fix."""
    volume = tmp_path / "runs"
    volume.mkdir(mode=0o755)
    start = time.monotonic()
    container = podman_run.run("unwritable", volume, [])
    code = container.wait()
    timed("unwritable volume", start)
    logs = container.logs()
    assert code == USAGE, logs
    (line,) = [x for x in logs.splitlines() if "not writable" in x]
    assert "uid 10001" in line and "/runs" in line, line
    assert "chown" in line and "10001" in line and "--user" in line, line
    assert list(volume.iterdir()) == [], "something was written"
    assert "Traceback" not in logs, logs


def test_image_holds_no_build_secret(podman_run: Runner) -> None:
    """The CA bundle handed to pip as a build secret is in no layer and in no variable."""
    host = podman_run.host
    if host.ca_bundle is None:
        pytest.skip("no CA bundle on this host: the build had no secret")
    start = time.monotonic()
    bundle = host.ca_bundle.read_bytes()
    digest = hashlib.sha256(bundle).hexdigest()
    # every file of the bundle's size, hashed inside the image
    script = (
        "import hashlib, os, sys\n"
        "size, found = int(sys.argv[1]), []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/proc', '/sys')]\n"
        "    for f in files:\n"
        "        p = os.path.join(root, f)\n"
        "        if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) == size:\n"
        "            found.append(hashlib.sha256(open(p, 'rb').read()).hexdigest())\n"
        "print(' '.join(found))\n"
    )
    out = podman(
        host,
        "run", "--rm", "--user", "0", "--entrypoint", "python",
        podman_run.image, "-c", script, str(len(bundle)),
    )  # fmt: skip
    assert digest not in out.split()
    env = json.loads(
        podman(host, "image", "inspect", "--format", "{{json .Config.Env}}", podman_run.image)
    )
    assert not [e for e in env if "CERT" in e or "CA_BUNDLE" in e], env
    history = podman(host, "history", "--no-trunc", "--format", "{{.CreatedBy}}", podman_run.image)
    assert "BEGIN CERTIFICATE" not in history
    timed("image searched for the build secret", start)


def test_a_source_edit_rebuilds_in_seconds(podman_run: Runner, tmp_path: Path) -> None:
    """The build context copied with one source file changed: every layer up to the locked
    dependencies comes from the cache, only the source layers are built again."""
    context = tmp_path / "context"
    for rel in ("pyproject.toml", "README.md", ".dockerignore", "docker", "launcher", "core",
                "checkpointing", "configs"):  # fmt: skip
        src = REPO / rel
        dst = context / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    edited = context / "launcher" / "__init__.py"
    edited.write_text(edited.read_text() + f"# edited by {__name__}\n")
    tag = f"{podman_run.image}-edit"
    try:
        seconds = build_image(podman_run.host, tag, context)
        print(f"\n[podman] rebuild after a source edit: {seconds:.1f} s")
        assert seconds < 60
    finally:
        podman(podman_run.host, "rmi", "--force", tag, check=False)
