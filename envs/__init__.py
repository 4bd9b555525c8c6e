"""Ready environments for dora. Each subpackage imports only dora's public API (`dora.env`).

- `envs.math`: chain arithmetic (generated, long-tailed solution lengths, exact reward) and
  GSM8K-format datasets (`####` / `\\boxed{}` answers, optional math-verify scoring).
- `envs.verifiers`: verifiers environments (`load_environment`: `SingleTurnEnv`, `MultiTurnEnv`,
  `ToolEnv`), each episode their own rollout on the episode's endpoint, and verifiers.v1
  tasksets, rolled out by dora's chat loop there; scored by their own reward functions.
- `envs.reasoning_gym`: any reasoning-gym dataset by name and config, scored by its own checker
  (extra `reasoning-gym`).
"""
