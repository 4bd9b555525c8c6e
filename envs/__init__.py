"""Ready environments for dora. Each subpackage imports only dora's public API (`dora.env`).

- `envs.math`: chain arithmetic (generated, long-tailed solution lengths, exact reward) and
  GSM8K-format datasets (`####` / `\\boxed{}` answers, optional math-verify scoring).
- `envs.verifiers`: verifiers (0.4) tasksets, rolled out by dora's chat loop on the episode's
  endpoint, scored by their own reward functions.
- `envs.reasoning_gym`: any reasoning-gym dataset by name and config, scored by its own checker
  (extra `reasoning-gym`).
"""
