"""`python -m dora.emulated`: an emulated cluster of instances (cluster.py). Started with
`DORA_PARENT_PID` (what `dora serve` does), it dies with that parent (`dora/lifetime.py`)."""

import sys

from dora.emulated.cluster import main
from dora.lifetime import die_with_parent_from_env

die_with_parent_from_env()
sys.exit(main())
