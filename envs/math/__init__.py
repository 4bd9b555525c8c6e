"""Math environments: generated chain arithmetic and GSM8K-format datasets.

from envs.math import ChainArithmeticEnv, chain_arithmetic_tasks
tasks = chain_arithmetic_tasks(1000, seed=0)          # long-tailed solution lengths
env_factory = load_env("envs.math:ChainArithmeticEnv")

tasks = load_gsm8k("data/gsm8k_train.jsonl")           # or .parquet, or "openai/gsm8k" online
env_factory = load_env("envs.math:GSM8KEnv", scorer="math_verify")
"""

from envs.math.answers import (
    exact_match,
    extract_answer,
    extract_boxed_answer,
    extract_hash_answer,
    math_verify_available,
    math_verify_match,
    normalize_answer,
)
from envs.math.chain import chain_arithmetic_tasks, chain_problem
from envs.math.env import ChainArithmeticEnv, GSM8KEnv, MathEnv
from envs.math.gsm8k import load_gsm8k

__all__ = [
    "ChainArithmeticEnv",
    "GSM8KEnv",
    "MathEnv",
    "chain_arithmetic_tasks",
    "chain_problem",
    "exact_match",
    "extract_answer",
    "extract_boxed_answer",
    "extract_hash_answer",
    "load_gsm8k",
    "math_verify_available",
    "math_verify_match",
    "normalize_answer",
]
