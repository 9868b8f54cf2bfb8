"""One trainer rank's process: ``python -m areal_agents.trainer.rank CONFIG --summary PATH``.

:func:`areal_agents.trainer.distributed.launch` starts ``train.nproc`` of these through
``torch.distributed``'s elastic agent. Each joins the process group; rank 0 runs the whole
:class:`~areal_agents.trainer.loop.Trainer` with a :class:`~areal_agents.trainer.distributed.Ranks`
command channel and writes its last-step metrics to ``--summary``; the other ranks only
:func:`~areal_agents.trainer.distributed.serve` its commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import transformers
from torch.distributed.elastic.multiprocessing.errors import record

from areal_agents.trainer import fsdp
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.distributed import Ranks, _die_with_parent, serve
from areal_agents.trainer.loop import Trainer


def rank_main(argv: Sequence[str] | None = None) -> int:
    """One trainer rank (started by :func:`areal_agents.trainer.distributed.launch`)."""
    return int(record(_rank_main)(argv) or 0)


def _rank_main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_agents.trainer.rank")
    p.add_argument("config")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--summary", required=True)
    args = p.parse_args(argv)
    _die_with_parent()
    cfg = load_config(args.config)
    fsdp.init_process_group(cfg.train.collective_timeout_s)
    try:
        if fsdp.rank() != 0:
            _quiet_libraries()
            serve(cfg.train.seed)
            return 0
        ranks = Ranks(cfg.train.seed)
        trainer = Trainer(cfg, resume=args.resume, quiet=args.quiet, ranks=ranks)
        summary = asyncio.run(trainer.run())
        ranks.stop()
        Path(args.summary).write_text(json.dumps(summary))
        return 0
    finally:
        fsdp.destroy_process_group()


def _quiet_libraries() -> None:
    """Ranks other than 0 print nothing routine (rank 0 shows the progress)."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(rank_main())
