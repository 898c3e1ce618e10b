"""`python -m studies ...`: the evidence suite's command (see studies/cli.py)."""

import sys

from studies.cli import main

main(sys.argv[1:])
