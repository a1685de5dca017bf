"""This host, ready to build and run the images with podman, without a container registry.

`python -m tests.deploy.podman_setup` (root) installs Debian's podman when missing, writes the
containers.conf the tests use, builds the base image the Dockerfiles name (python:3.11.7-slim-
bookworm) from Debian's archive with debootstrap, imports it under that name, and fills a
wheelhouse with every wheel the CPU image installs, so that an image build installs offline
(`PIP_NO_INDEX=1`). Everything it makes is cached under `${XDG_CACHE_HOME:-~/.cache}/resumable-
trainer/`, keyed by its inputs, so a second call only checks (a fraction of a second). Standard
library only (Python 3.11+ for tomllib).

Why each piece (found on Debian 12, podman 4.3.1, kernel with hybrid cgroups v1):
- runtime runc: crun refuses hybrid cgroups;
- default_ulimits: podman gives containers nofile/nproc limits above this host's hard limits
  (runc then fails with "error setting rlimits ... operation not permitted"), so they are set
  to what this host allows (nproc at most pid_max: above it runc's setrlimit was refused here,
  and podman's conmon ran with nproc = pid_max);
- the base image: no registry is reachable, and the official image is Debian bookworm plus a
  Python 3.11; debootstrap + python3-venv gives the same shape (`python3 -m venv` works);
- the wheelhouse, not pip's cache: pip caches nothing behind a proxy that drops the caching
  headers (as this one does), so only wheels kept on disk spare a rebuild the downloads.
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
# debian-archive-keyring: debootstrap verifies Debian's archive with it (not on Ubuntu by default)
HOST_PACKAGES = (
    *("podman", "runc", "debootstrap", "uidmap", "fuse-overlayfs"),
    "debian-archive-keyring",
)
HOST_FILES = (
    *(f"/usr/bin/{c}" for c in ("podman", "newuidmap", "fuse-overlayfs")),
    "/usr/sbin/runc",
    "/usr/sbin/debootstrap",
    "/usr/share/keyrings/debian-archive-keyring.gpg",
)
SUITE = "bookworm"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
# Bump when the recipe in build_base_tarball changes: the cached tarball is then rebuilt.
RECIPE_VERSION = 1
WHEELHOUSE_VERSION = 1  # bump when fill_wheelhouse changes
CPU_DOCKERFILE = REPO / "docker" / "Dockerfile.cpu"
LOCK = REPO / "docker" / "requirements.lock"
EXTRAS = ("deepspeed", "s3")  # the extras the images install, as docker/Dockerfile.cpu does
BASE_LABEL = "org.resumable-trainer.base-recipe"


class Forbidden(Exception):
    """This machine cannot run containers (the tests skip, naming the reason)."""


@dataclass(frozen=True)
class Host:
    """What the tests need to call podman here."""

    containers_conf: Path
    base_image: str
    wheels: Path  # every wheel the CPU image installs (build with PIP_NO_INDEX=1)
    ca_bundle: Path | None  # handed to pip in a build as the pip_ca secret

    def env(self) -> dict[str, str]:
        """The environment of every podman call (podman reads CONTAINERS_CONF)."""
        return {**os.environ, "CONTAINERS_CONF": str(self.containers_conf)}


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "resumable-trainer"


def log(message: str) -> None:
    print(f"podman_setup: {message}", file=sys.stderr, flush=True)


def key(*parts: object) -> str:
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:16]


def build_arg(name: str, dockerfile: Path = CPU_DOCKERFILE) -> str:
    """The default of `ARG name=...` in the Dockerfile."""
    (value,) = re.findall(rf"^ARG {name}=(\S*)$", dockerfile.read_text(), re.M)
    return value.strip('"')


def ca_bundle() -> Path | None:
    """The CA bundle this host's pip trusts (a TLS-intercepting proxy's CA is in it), if any."""
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return Path(os.environ[var])
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return default if default.is_file() else None


def base_image_name(dockerfile: Path = CPU_DOCKERFILE) -> str:
    """The CPU Dockerfile's FROM, as podman stores it (docker.io/library/NAME for a bare NAME)."""
    (name,) = re.findall(r"^FROM\s+(\S+)", dockerfile.read_text(), re.M)
    first = name.split("/")[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def install_packages() -> None:
    missing = [f for f in HOST_FILES if not Path(f).exists()]
    if not missing:
        return
    log(f"installing {' '.join(HOST_PACKAGES)} (missing: {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", *HOST_PACKAGES], check=True, env=env)


def check_namespaces() -> None:
    """Containers need new namespaces: a kernel or sandbox that refuses them forbids containers."""
    cmd = ["unshare", "--fork", "--pid", "--mount", "--net", "--uts", "--ipc", "true"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise Forbidden(f"this kernel refuses new namespaces: {result.stderr.strip()}")


def write_containers_conf(path: Path) -> None:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 20)
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    text = (
        "# Written by tests/deploy/podman_setup.py; used through CONTAINERS_CONF.\n"
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
    )
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def build_base_tarball(tarball: Path) -> None:
    """Debian minbase + Python 3 with venv and pip, apt caches dropped, as one tar."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        include = ",".join(BASE_PACKAGES)
        cmd = ["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(rootfs)]
        log(f"{' '.join(cmd)} {MIRROR} (a few minutes, once)")
        subprocess.run([*cmd, MIRROR], check=True, stdout=subprocess.DEVNULL)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        partial = tarball.with_suffix(".partial")
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], check=True
        )
        partial.replace(tarball)
    log(f"base tarball {tarball.name} in {time.monotonic() - start:.0f} s")


def podman(host_env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=host_env, text=True, capture_output=True, **kw)


def import_base(env: dict[str, str], tarball: Path, name: str, recipe: str) -> None:
    """Import the tarball as `name`, unless podman has it from this recipe already."""
    label = f'{{{{index .Labels "{BASE_LABEL}"}}}}'
    inspect = podman(env, "image", "inspect", "--format", label, name)
    if inspect.returncode == 0 and inspect.stdout.strip() == recipe:
        return
    changes = [
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8",
        f"LABEL {BASE_LABEL}={recipe}",
        'CMD ["python3"]',
    ]
    args = [a for c in changes for a in ("--change", c)]
    podman(env, "import", *args, str(tarball), name, check=True)
    log(f"imported {tarball.name} as {name}")


def prune(directory: Path, pattern: str, keep: Path) -> None:
    """Drop cache entries of other keys, so the cache holds one of each."""
    for old in directory.glob(pattern):
        if old == keep:
            continue
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()


def requirements() -> list[str]:
    """What the CPU image's dependency layer installs: the project's dependencies, its EXTRAS'
    and setuptools (the editable install's backend); torch comes from TORCH_SPEC."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for e in EXTRAS for r in project["optional-dependencies"][e]]
    return [*project["dependencies"], *extras, "setuptools"]


def local_find_links() -> list[Path]:
    """This host's own wheel directories, e.g. one holding the torch wheel: PIP_FIND_LINKS, and
    pip's own configuration (pip.conf's find-links), where an environment lacks the variable."""
    text = os.environ.get("PIP_FIND_LINKS", "")
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    for line in listed.stdout.splitlines():
        name, _, value = line.partition("=")
        if name.strip().endswith("find-links"):
            text += " " + value.strip().strip("'\"")
    dirs = list(dict.fromkeys(Path(d) for d in text.split()))
    return [d for d in dirs if d.is_dir()]


def fill_wheelhouse(env: dict[str, str], wheels: Path, base_image: str) -> None:
    """Every wheel of TORCH_SPEC and requirements() at the lock's versions, downloaded or built
    (deepspeed is an sdist) by the base image's own pip, so they fit its Python."""
    start = time.monotonic()
    partial = wheels.with_name(wheels.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    (partial / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    mounts = ["-v", f"{partial}:/wheels", "-v", f"{LOCK}:/requirements.lock:ro"]
    links = ["/wheels"]
    for i, d in enumerate(local_find_links()):
        mounts += ["-v", f"{d}:/links/{i}:ro"]
        links.append(f"/links/{i}")
    bundle = ca_bundle()
    if bundle is not None:
        mounts += ["-v", f"{bundle}:/run/pip_ca.crt:ro", "-e", "PIP_CERT=/run/pip_ca.crt"]
    torch_spec, torch_index = build_arg("TORCH_SPEC"), build_arg("TORCH_INDEX_URL")
    script = (
        "set -e; python3 -m venv /tmp/venv; pip=/tmp/venv/bin/pip; "
        # torch from its index, or from a local wheel directory (one retry: an unreachable
        # index then costs seconds, not a minute)
        f'$pip download -q --retries 1 --no-deps -d /wheels --index-url "{torch_index}" '
        f'"{torch_spec}"; '
        # the rest as wheels; torch pinned to the one just saved (PyPI has later ones)
        f'$pip wheel -q --use-pep517 -w /wheels -c /requirements.lock "{torch_spec}" '
        "-r /wheels/requirements.txt"
    )
    log(f"filling the wheelhouse {wheels.name} (a few minutes, once per lock)")
    mounts += ["-e", f"PIP_FIND_LINKS={' '.join(links)}"]
    cmd = ["podman", "run", "--rm", *mounts, base_image, "sh", "-c", script]
    subprocess.run(cmd, env=env, check=True)
    (partial / "requirements.txt").unlink()
    partial.replace(wheels)
    count = len(list(wheels.glob("*.whl")))
    log(f"wheelhouse {wheels.name}: {count} wheels in {time.monotonic() - start:.0f} s")


def wheelhouse_key(base_recipe: str) -> str:
    """The lock pins every version; the requirements, TORCH_SPEC and base image choose which."""
    lock = LOCK.read_text()
    return key(WHEELHOUSE_VERSION, base_recipe, lock, *requirements(), build_arg("TORCH_SPEC"))


def setup() -> Host:
    """Everything above, idempotent; raises Forbidden where containers cannot run."""
    if os.geteuid() != 0:
        raise Forbidden(
            "rootful podman, apt-get and debootstrap need root (run the deploy tests as root, "
            "e.g. sudo -E make test-deploy)"
        )
    install_packages()
    check_namespaces()
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    conf = cache / "containers.conf"
    write_containers_conf(conf)
    recipe = key(RECIPE_VERSION, SUITE, *BASE_PACKAGES)
    tarball = cache / f"base-{SUITE}-{recipe}.tar"
    if not tarball.is_file():
        build_base_tarball(tarball)
    prune(cache, "base-*.tar", tarball)
    wheels = cache / f"wheels-{wheelhouse_key(recipe)}"
    host = Host(conf, base_image_name(), wheels, ca_bundle())
    import_base(host.env(), tarball, host.base_image, recipe)
    if not wheels.is_dir():
        fill_wheelhouse(host.env(), wheels, host.base_image)
    prune(cache, "wheels-*", wheels)
    return host


def main() -> int:
    start = time.monotonic()
    try:
        host = setup()
    except Forbidden as e:
        # not a failure of this stage: the tests then skip, giving the same reason
        log(f"containers cannot run here, the podman tests will skip: {e}")
        return 0
    log(f"ready in {time.monotonic() - start:.1f} s")
    print(f"CONTAINERS_CONF={host.containers_conf}")
    print(f"BASE_IMAGE={host.base_image}")
    print(f"WHEELS={host.wheels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
