"""`python -m pretrain.probe`: the rank-local probe's command line (pretrain/probe/cli.py)."""
import sys

from pretrain.probe.cli import main

sys.exit(main())
