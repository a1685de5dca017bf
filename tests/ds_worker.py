"""Worker for tests/test_core/engines/test_deepspeed.py: trains exactly as `python -m launcher` does
(same session, same Trainer), then writes the live model's full weights with
`Trainer.save_model` into argv[1], so a test can compare them with what
`python -m checkpointing export` makes of the checkpoint.

    torchrun --standalone --nproc-per-node 2 -m tests.ds_worker OUT_DIR --config ... [overrides]
"""

from __future__ import annotations

import sys

from core.config import load_config
from core.trainer import Trainer
from launcher.dist import env_rank, exit_worker
from launcher.logs import setup_logging
from launcher.main import parse_args
from launcher.session import session


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    setup_logging(env_rank())
    path, overrides = parse_args(rest)
    config = load_config(path, overrides)
    with session(config.engine, config.run.log_level, config.run.full_determinism) as s:
        trainer = Trainer(args=config, dist_info=s.info, device=s.device, stop_requested=s.stop)
        trainer.train()
        trainer.save_model(out)
    return 0


if __name__ == "__main__":
    exit_worker(main(sys.argv[1:]))  # as launcher/__main__.py ends
