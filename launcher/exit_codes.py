"""Process exit codes of `python -m launcher` (documented in the README)."""

OK = 0
"""Training finished (max_steps or num_epochs reached, or a callback stopped it)."""
FAILURE = 1
"""An unexpected error; the traceback is logged (and written to torchrun's error file)."""
USAGE = 2
"""Bad config, command line or data: one line names the input; nothing was written."""
INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT)."""
