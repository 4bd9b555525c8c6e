"""`python -m dora.emulated`: an emulated cluster of instances (cluster.py)."""

import sys

from dora.emulated.cluster import main

sys.exit(main())
