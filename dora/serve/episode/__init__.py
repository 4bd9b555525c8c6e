"""The episode runner's old import path: everything here is `dora.episode`'s (its `__all__`).

The runner is public API and serve is one of its users, so it lives outside serve
(`dora/episode.py`); models and environments import it from there.
"""

from dora.episode import *  # noqa: F403  (whatever dora.episode exports, this path exports)
from dora.episode import __all__ as __all__
