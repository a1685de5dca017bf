"""A real Slurm cluster on this host for the deploy tests: munged, slurmctld and two slurmd
(nodes n1 and n2, both 127.0.0.1), started without systemd, everything (slurm.conf, munge key,
state, spool, logs, pid files) under one directory; clients find it through SLURM_CONF.

`python -m tests.deploy.slurm install` installs Debian's slurm-wlm and munge when missing and
names n1, n2 in /etc/hosts (root); the `slurm_cluster` fixture then starts the daemons once per
session and stops them, by pid, at the end. `python -m tests.deploy.slurm start DIR` runs one
by hand until Ctrl-C (`export SLURM_CONF=DIR/slurm.conf` for sinfo, sbatch, squeue...).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

PACKAGES = ("slurm-wlm", "munge")
INSTALL = "python -m tests.deploy.slurm install"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch")
NODES = ("n1", "n2")
# Each node declares 4 CPUs, whatever this host has (config_overrides): jobs ask one CPU per
# node and mostly wait (startup, paced steps, requeues), so eight share two cores well enough.
CPUS_PER_NODE = 4
# The lowest credential lifetime Slurm accepts (slurm_cred.c refuses < 5 s): a requeued job is
# eligible again cred_expire + 1 s later instead of the default 121 s.
CRED_EXPIRE_S = 5
GRACE_TIME_S = 60  # partition `low`: SIGTERM, then this long to checkpoint before the kill

# Job states that end a job (a requeued one is PENDING again).
FINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]


def install() -> None:
    """apt-get the packages when a daemon is missing; n1, n2 -> 127.0.0.1 in /etc/hosts."""
    if missing():
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", *PACKAGES], check=True, env=env)
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    absent = [n for n in NODES if not re.search(rf"^\s*127\.0\.0\.1\s.*\b{n}\b", text, re.M)]
    if absent:
        with hosts.open("a") as f:
            f.write(f"127.0.0.1 {' '.join(absent)}\n")


def why_not() -> str | None:
    """Why the daemons cannot run here, or None."""
    if os.geteuid() != 0:
        return "the daemons need root (slurmd runs each job as the user who submitted it)"
    if missing():
        return f"not installed: {', '.join(missing())} ({INSTALL})"
    for node in NODES:
        try:
            address = socket.gethostbyname(node)
        except OSError:
            address = "nothing"
        if address != "127.0.0.1":
            return f"{node} resolves to {address}, not 127.0.0.1 ({INSTALL})"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={p} CPUs={CPUS_PER_NODE} "
        "Gres=token:1 State=UNKNOWN"
        for n, p in node_ports.items()
    )
    names = ",".join(node_ports)
    return f"""\
ClusterName=deploytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
MpiDefault=none
GresTypes=token
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=5
KillWait=10
InactiveLimit=0
MinJobAge=600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
# debug: jobs nothing preempts; low: preempted (requeued) by jobs of urgent, after a SIGTERM
# and GraceTime seconds. A job of urgent that needs the one `token` of a node preempts the low
# job holding it, and no other.
PartitionName=debug Nodes={names} Default=YES PriorityTier=1 PreemptMode=OFF
PartitionName=low Nodes={names} PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_TIME_S}
PartitionName=urgent Nodes={names} PriorityTier=2 PreemptMode=OFF
"""


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    """The environment for Slurm's clients (SLURM_CONF) on top of os.environ."""
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {result.returncode}: {result.stderr}")
        return result.stdout

    def sbatch(self, *args: str, env: dict[str, str], cwd: Path) -> int:
        """Submit as a user would; the job id."""
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**env, "SLURM_CONF": self.env["SLURM_CONF"]},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: exit {out.returncode}: {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def test_only(self, *args: str, cwd: Path) -> int:
        """`sbatch --test-only ARGS`: the exit code (0: the cluster would run it)."""
        return subprocess.run(
            ["sbatch", "--test-only", *args],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            timeout=30,
        ).returncode

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: int, until, timeout: float, poll: float = 0.5) -> dict[str, str]:
        """Poll the job until `until(job)` holds; the job record then."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')}: {info}")
            time.sleep(poll)

    def wait_done(self, job_id: int, timeout: float) -> dict[str, str]:
        return self.wait_job(job_id, lambda j: j["JobState"] in FINAL, timeout)

    def wait_gone(self, job_id: int, timeout: float) -> None:
        """Until squeue no longer lists the job: ended, its processes gone (not COMPLETING)."""
        _wait_for(
            lambda: (
                not self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).strip()
            ),
            timeout,
            f"job {job_id} still listed by squeue",
        )

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = self.node_states()
            except (RuntimeError, subprocess.TimeoutExpired):
                states = {}
            if all(states.get(n) in ("idle", "mix", "alloc") for n in NODES):
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not up after {timeout} s: {states}; logs in {self.root}/log")

    def start_slurmd(self, node: str) -> None:
        self.daemons[f"slurmd-{node}"] = self._start("slurmd", "-D", "-N", node)

    def kill_slurmd(self, node: str) -> None:
        proc = self.daemons.pop(f"slurmd-{node}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def job_processes(self, job_id: int, node: str) -> list[psutil.Process]:
        """The processes of job `job_id` on `node`: its tasks (SLURM_JOB_ID and SLURMD_NODENAME
        in their environment), their slurmstepd, and everything below them."""
        tasks = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURMD_NODENAME") == node:
                tasks.append(p)
        found: dict[int, psutil.Process] = {}
        for p in tasks:
            try:
                parent = p.parent()
                if parent is not None and parent.name().startswith("slurmstepd"):
                    found[parent.pid] = parent
                found[p.pid] = p
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.Error:
                continue
        return list(found.values())

    def listener_node(self, port: int) -> str | None:
        """The node (SLURMD_NODENAME) of the job process listening on TCP `port`."""
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                try:
                    return psutil.Process(conn.pid).environ().get("SLURMD_NODENAME")
                except psutil.Error:
                    return None
        return None

    def stop(self) -> None:
        """Stop every daemon this cluster started, by pid: slurmd, slurmctld, then munged.
        Jobs still running are cancelled first, so no job step outlives the cluster."""
        if "slurmctld" in self.daemons:
            self.run("scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name, check=False)
        for name in [n for n in self.daemons if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            proc = self.daemons.pop(name, None)
            if proc is None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # slurmstepd daemonises away from slurmd: end what this cluster's jobs left behind
        # (every process of theirs inherited SLURM_CONF from the daemons or the submitter).
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == self.env["SLURM_CONF"]:
                    p.kill()
            except (psutil.Error, OSError):
                continue

    def _start(self, *cmd: str) -> subprocess.Popen:
        """A daemon in the foreground; what it says before its log file opens goes to .out."""
        name = f"slurmd-{cmd[-1]}" if cmd[0] == "slurmd" else cmd[0]
        with (self.root / "log" / f"{name}.out").open("ab") as log:
            return subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )


def start_cluster(root: Path) -> Cluster:
    """Write the config and key under `root`, start munged, slurmctld, the two slurmd; return
    once sinfo shows both nodes up."""
    for sub in ("munge", "state", "spool", "run", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for node in NODES:
        (root / "spool" / node).mkdir(exist_ok=True)
    root.chmod(0o755)  # munged refuses a key or socket directory others may write
    key = root / "munge" / "munge.key"
    subprocess.run(["mungekey", "--create", "--force", f"--keyfile={key}"], check=True)
    key.chmod(0o600)
    conf = root / "slurm.conf"
    ports = {n: free_port() for n in NODES}
    conf.write_text(slurm_conf(root, free_port(), ports))
    (root / "gres.conf").write_text(f"NodeName={','.join(NODES)} Name=token Count=1\n")
    cluster = Cluster(root, {**os.environ, "SLURM_CONF": str(conf)})
    try:
        m = root / "munge"
        cluster.daemons["munged"] = cluster._start(
            "munged",
            "-F",
            "-f",
            f"--socket={m}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={m}/munged.pid",
            f"--log-file={root}/log/munged.log",
            f"--seed-file={m}/munged.seed",
        )
        _wait_for(lambda: (m / "munge.socket").exists(), 20, f"munged: {root}/log/munged.log")
        cluster.daemons["slurmctld"] = cluster._start("slurmctld", "-D", "-i")
        for node in NODES:
            cluster.start_slurmd(node)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout} s: {what}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """The cluster, started once per session (installed first, when root, if missing)."""
    if os.geteuid() == 0 and why_not() is not None:
        install()
    reason = why_not()
    if reason is not None:
        pytest.skip(f"no Slurm cluster here: {reason}")
    start = time.monotonic()
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    print(f"slurm cluster up in {time.monotonic() - start:.1f} s: {cluster.root}")
    yield cluster
    cluster.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        install()
    elif len(sys.argv) == 3 and sys.argv[1] == "start":
        c = start_cluster(Path(sys.argv[2]))
        print(f"export SLURM_CONF={c.env['SLURM_CONF']}")
        print({k: p.pid for k, p in c.daemons.items()})
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            c.stop()
    else:
        sys.exit("usage: python -m tests.deploy.slurm install | start DIR")
