"""An OpenAI-compatible endpoint per episode, token-exact and pinned to the episode's version, and
the environments whose episodes are an agent's own loop against it (`AgentEnv`, `agent_env`).

See docs/environments.md ("Your own agent loop"): `agent` runs the episode, `session` samples and
records each call, `requests` turns request bodies into prompt ids, `record` builds the sample,
`server` serves every episode of a process under a path of its own.
"""

from dora.endpoint.agent import MODEL, AgentEnv, agent_env, run_agent_episode

__all__ = ["MODEL", "AgentEnv", "agent_env", "run_agent_episode"]
