"""`python -m pretrain` with a data loader that hangs on one rank (STUCK_RANK from step STUCK_STEP): for the watchdog test."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain.train as loop  # noqa: E402
from pretrain.__main__ import main  # noqa: E402

STUCK_RANK, STUCK_STEP = int(os.environ["STUCK_RANK"]), int(os.environ["STUCK_STEP"])
_get = loop.Batches.get


def get_or_hang(self, step: int, micro_index: int):
    if self.topo.rank == STUCK_RANK and step >= STUCK_STEP:
        while True:  # stuck in Python, outside any collective: only the watchdog sees it
            time.sleep(3600)
    return _get(self, step, micro_index)


loop.Batches.get = get_or_hang
sys.exit(main())
