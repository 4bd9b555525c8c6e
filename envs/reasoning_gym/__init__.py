"""reasoning-gym's procedurally generated tasks, scored by their own checkers (extra:
`pip install -e '.[reasoning-gym]'`, reasoning-gym 0.1.25 up to 0.2).

from envs.reasoning_gym import ReasoningGymEnv, dataset_names
env_factory = load_env("envs.reasoning_gym:ReasoningGymEnv", dataset="chain_sum", max_terms=3)
"""

from envs.reasoning_gym.datasets import (
    HELD_OUT_SEED,
    dataset_names,
    extract_answer,
    format_reply,
    held_out,
    make_dataset,
)
from envs.reasoning_gym.env import ReasoningGymEnv
from envs.reasoning_gym.solutions import running_sums

__all__ = [
    "HELD_OUT_SEED",
    "ReasoningGymEnv",
    "dataset_names",
    "extract_answer",
    "format_reply",
    "held_out",
    "make_dataset",
    "running_sums",
]
