"""docker/examples/slurm.sbatch submitted to a real Slurm (tests/deploy/slurm.py: two nodes on
this host), as a user would: sbatch from the repository root, CPU settings through the script's
environment settings, launcher options after the script name. Every run that Slurm interrupts
must end with the losses, step for step, of an uninterrupted run of the same shape.

All jobs are submitted at once when the module starts and the cluster runs what fits (n1 takes
four one-CPU tasks at a time); a thread per job that needs an event (a preemption, a scancel,
a lost node) acts once the job has trained a few steps; each test then waits for its job and
checks it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.checkpoints import assert_same_losses
from tests.conftest import free_port
from tests.deploy.slurm import Cluster
from tests.launch import REPO, child_env, read_metrics

SCRIPT = "docker/examples/slurm.sbatch"  # submitted from REPO, as the README says
STEPS = 100
COMMON = [
    "--train.max_steps", str(STEPS),
    "--data.max_bytes", "200000",
    "--train.logging_steps", "1",
    "--train.progress_bar", "never",
]  # fmt: skip
NO_SAVES = ["--checkpoint.save_steps", "1000"]  # only the checkpoint a signal asks for
SAVES = ["--checkpoint.save_steps", "10"]


def paced(seconds: float) -> list[str]:
    """tiny-gpt, each step `seconds` slower in a job's first attempt (tests/deploy/paced_model)."""
    return [
        "--model.name",
        "tests.deploy.paced_model:factory",
        "--model.kwargs",
        f"{{pace_s: {seconds}}}",
    ]


@dataclass
class Job:
    name: str
    dir: Path
    sbatch: list[str]
    options: list[str]
    env: dict[str, str] = field(default_factory=dict)
    act: Callable[[Cluster, Job], None] | None = None
    """Run in a thread once the job is submitted: the event the test is about."""
    after: tuple[str, ...] = ()
    """Jobs (by name) this one starts after (--dependency=afterany)."""
    notes: dict[str, str] = field(default_factory=dict)
    """What `act` did (the preempting job's id, the pids it killed)."""
    id: int = 0
    port: int = 0
    """The c10d rendezvous port (RDZV_PORT)."""
    submitted: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    def output(self) -> str:
        path = self.dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.is_file() else ""

    def steps(self) -> int:
        try:
            return len(read_metrics(self.run_dir))
        except (OSError, ValueError):
            return 0

    def submit(self, cluster: Cluster, others: dict[str, Job]) -> None:
        self.dir.mkdir(parents=True)
        self.port = free_port()
        env = child_env({"OUTPUT_DIR": str(self.run_dir), "RDZV_PORT": str(self.port), **self.env})
        env.pop("OMP_NUM_THREADS")  # the script sets it from the job's CPUs
        self.submitted = time.monotonic()
        if self.after:
            ids = ":".join(str(others[name].id) for name in self.after)
            self.sbatch = [f"--dependency=afterany:{ids}", *self.sbatch]
        self.id = cluster.sbatch(
            f"--output={self.dir}/slurm-%j.out", "--job-name", self.name, *self.sbatch,
            SCRIPT, *self.options, env=env, cwd=REPO,
        )  # fmt: skip
        if self.act is None:
            self.done.set()
            return

        def act() -> None:
            try:
                self.act(cluster, self)
            except BaseException as e:  # reported by the job's test
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=act, name=f"slurm-{self.name}", daemon=True).start()

    def wait_steps(self, cluster: Cluster, steps: int, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while self.steps() < steps:
            state = cluster.job(self.id)["JobState"]
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED"):
                raise AssertionError(f"{self.name}: {state} before step {steps}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not at step {steps} after {timeout} s")
            time.sleep(0.2)

    def finish(self, cluster: Cluster, timeout: float = 300) -> dict[str, str]:
        """Wait for the job's end (and its event); its record, the duration printed."""
        assert self.done.wait(timeout), f"{self.name}: its event did not happen in {timeout} s"
        if self.error is not None:
            raise self.error
        info = cluster.wait_done(self.id, timeout)
        print(f"{self.name}: job {self.id} {info['JobState']} after {info['Restarts']} requeue(s), "
              f"{time.monotonic() - self.submitted:.0f} s from submit")  # fmt: skip
        return info


def note_store(cluster: Cluster, job: Job) -> None:
    job.wait_steps(cluster, 1)
    job.notes["store on"] = cluster.listener_node(job.port)


def preempt(cluster: Cluster, job: Job) -> None:
    """A job of a higher-tier partition needs the token this `low` job holds: Slurm preempts it
    (PreemptMode=REQUEUE, GraceTime): SIGTERM to its steps, a kill after the grace time."""
    job.wait_steps(cluster, 10)
    node = cluster.job(job.id)["NodeList"]
    job.notes["urgent"] = str(cluster.sbatch(
        "--partition=urgent", f"--nodelist={node}", "--gres=token:1", "--output=/dev/null",
        "--wrap", "sleep 2", env=child_env(), cwd=job.dir,
    ))  # fmt: skip


def cancel(cluster: Cluster, job: Job) -> None:
    job.wait_steps(cluster, 15)  # past checkpoint-10: progress the script must not act on
    cluster.run("scancel", str(job.id))


def lose_node(cluster: Cluster, job: Job) -> None:
    """n2 dies: its slurmd and this job's processes on it are killed (by pid); once Slurm has
    given up on the node (the job is requeued), the node comes back."""
    job.wait_steps(cluster, 25)
    job.notes["store on"] = cluster.listener_node(job.port)
    procs = cluster.job_processes(job.id, "n2")
    assert procs, f"no process of job {job.id} on n2"
    cluster.kill_slurmd("n2")
    for p in procs:
        p.kill()
    job.notes["killed"] = " ".join(str(p.pid) for p in procs)
    cluster.wait_job(job.id, lambda j: j["JobState"] != "RUNNING", timeout=90)
    cluster.start_slurmd("n2")
    cluster.wait_idle()


@pytest.fixture(scope="module")
def jobs(slurm_cluster: Cluster, tmp_path_factory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("slurm-jobs")
    # One-node jobs run on n1: n2 carries only the two-node jobs, one after the other, so the
    # node lost takes down no other test's job.
    limit = "--time=10"  # a hung job ends; also lets the scheduler plan (backfill)
    one, two = ["--nodes=1", "--nodelist=n1", limit], ["--nodes=2", limit]
    wanted = [
        # The time limit's warning comes 60 to 90 s after the start (slurmctld looks every
        # 30 s): the first attempt trains 100 s, the requeued one at full speed.
        Job("time-limit", root / "time-limit",
            ["--nodes=1", "--nodelist=n1", "--time=3", "--signal=B:USR1@90"],
            [*COMMON, *NO_SAVES, *paced(1.0)], env={"SHUTDOWN_TIMEOUT": "30"}),
        Job("reference-2", root / "reference-2", two, [*COMMON, *NO_SAVES], act=note_store),
        # A lost node takes down every job on it: this one follows reference-2, the only other
        # job on n2.
        Job("lost-node", root / "lost-node", two, [*COMMON, *SAVES, *paced(0.3)],
            after=("reference-2",), act=lose_node),
        Job("reference-1", root / "reference-1", one, [*COMMON, *NO_SAVES],
            env={"CONFIG": "configs/tiny.yaml", "SHUTDOWN_TIMEOUT": "30", "NPROC_PER_NODE": "1"}),
        Job("preempted", root / "preempted", ["--partition=low", "--gres=token:1", *one],
            [*COMMON, *NO_SAVES, *paced(0.3)],
            env={"TORCHRUN": ".venv/bin/torchrun", "SHUTDOWN_TIMEOUT": "30"}, act=preempt),
        Job("crash", root / "crash", one, [*COMMON, *SAVES, "--model.name",
            "tests.crashy_model:factory", "--model.kwargs",
            f"{{marker: {root / 'crashed'}, crash_at: 25, crash_rank: 0}}"]),
        Job("bad-config", root / "bad-config", one, [*COMMON, "--train.no_such_key", "1"]),
        Job("cancelled", root / "cancelled", one, [*COMMON, *SAVES, *paced(0.3)], act=cancel),
    ]  # fmt: skip
    start = time.monotonic()
    by_name = {job.name: job for job in wanted}
    for job in wanted:
        job.submit(slurm_cluster, by_name)
    yield by_name
    for job in wanted:
        job.done.wait(60)
    print(f"slurm jobs: {time.monotonic() - start:.0f} s from the first submit to the last check")


def assert_ran_like(job: Job, reference: Job) -> None:
    assert_same_losses(reference.run_dir, job.run_dir)
    assert read_metrics(job.run_dir)[-1]["step"] == STEPS


def test_submits_on_a_cluster_without_gpus(slurm_cluster: Cluster) -> None:
    """The script's own #SBATCH lines ask for nothing a CPU cluster lacks (every job of this
    module ran it too); GPUs are the submitter's choice, which this cluster refuses."""
    assert "gpu" not in slurm_cluster.run("sinfo", "-h", "-o", "%G")
    assert slurm_cluster.test_only(SCRIPT, cwd=REPO) == 0
    assert slurm_cluster.test_only("--gpus-per-node=1", SCRIPT, cwd=REPO) != 0


def test_two_nodes_one_torchrun_each_c10d_on_the_first(jobs, slurm_cluster) -> None:
    job = jobs["reference-2"]
    info = job.finish(slurm_cluster)
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", out
    assert "1 worker(s) per node, OMP_NUM_THREADS=1" in out, out
    assert "2 rank(s)" in out, out
    assert job.notes["store on"] == "n1"  # the torchrun that hosts the c10d store
    assert read_metrics(job.run_dir)[-1]["step"] == STEPS


def test_time_limit_warning_checkpoints_requeues_and_resumes(jobs, slurm_cluster) -> None:
    job = jobs["time-limit"]
    info = job.finish(slurm_cluster)
    out = job.output()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, out
    assert "SIGUSR1 at" in out and "preempted at step" in out, out
    assert "requeueing job" in out and "resumed from" in out, out
    assert_ran_like(job, jobs["reference-1"])


def test_partition_preemption_with_grace_time_requeues_itself(jobs, slurm_cluster) -> None:
    """SIGTERM to the steps only; plain torchrun exits 1: the committed checkpoint decides."""
    job = jobs["preempted"]
    info = job.finish(slurm_cluster)
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert "preempted at step" in out and "workers ended with exit 1" in out, out
    assert "requeueing job" in out, out
    assert slurm_cluster.wait_done(int(job.notes["urgent"]), 60)["JobState"] == "COMPLETED"
    assert_ran_like(job, jobs["reference-1"])


def test_lost_node_requeues_and_resumes(jobs, slurm_cluster) -> None:
    job = jobs["lost-node"]
    info = job.finish(slurm_cluster, timeout=420)
    out = job.output()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, out
    assert "resumed from" in out, out
    assert job.notes["store on"] == "n1"  # the c10d store: hosted by the first node's torchrun
    assert_ran_like(job, jobs["reference-2"])


def test_crash_after_a_new_checkpoint_requeues(jobs, slurm_cluster) -> None:
    job = jobs["crash"]
    info = job.finish(slurm_cluster)
    out = job.output()
    assert "injected crash on rank 0" in out, out
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert "started from step 0, newest checkpoint step 20" in out, out
    assert "resumed from" in out, out
    assert_ran_like(job, jobs["reference-1"])


def test_failure_at_start_ends_the_job_with_its_code(jobs, slurm_cluster) -> None:
    job = jobs["bad-config"]
    info = job.finish(slurm_cluster)
    out = job.output()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", out
    assert info["Restarts"] == "0" and "requeueing" not in out, out


def test_cancelled_job_is_not_requeued(jobs, slurm_cluster) -> None:
    job = jobs["cancelled"]
    job.finish(slurm_cluster)
    slurm_cluster.wait_gone(job.id, timeout=60)  # the batch script too has ended
    info = slurm_cluster.job(job.id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", job.output()
