"""Process exit codes of `python -m launcher` (documented in the README, "Exit codes")."""

OK = 0
"""Training finished (max_steps or num_epochs reached, or a callback stopped it)."""
FAILURE = 1
"""An unexpected error; the traceback is logged (and written to torchrun's error file)."""
USAGE = 2
"""Bad config, command line or data: one line names the input; nothing was written."""
CHECKPOINT = 3
"""A checkpoint was refused: an explicit resume_from is corrupt or missing, the config differs
in fields that change the trajectory, or the resume self-check found a difference."""
STORAGE = 4
"""The checkpoint store failed after every retry (a save was not committed, or a checkpoint could
not be read); the committed checkpoints are intact: relaunch once the store is reachable."""
LEASE = 73
"""Another job holds this run's lease (waited run.lease_wait_s), or this job lost it to a job
that took the run over: nothing more was committed or deleted (EX_CANTCREAT)."""
PREEMPTED = 75
"""Stopped by SIGTERM/SIGUSR1 after committing a checkpoint at the agreed step: relaunch the same
command to continue (EX_TEMPFAIL)."""
INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT)."""
