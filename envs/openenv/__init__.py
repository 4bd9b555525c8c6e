"""OpenEnv environments: `OpenEnvEnv` runs each episode as one session of an OpenEnv environment
server (`openenv-core`, the `openenv` extra), found at a URL or served from its app in this process.

    [env]
    cls = "envs.openenv:OpenEnvEnv"
    kwargs = { url = "http://127.0.0.1:8000" }      # or { app = "my_env.server.app:app" }

`openenv` is imported only when the environment is loaded, so `import envs.openenv` works without
it. docs/environments.md ("OpenEnv environments") has the settings and what is supported.
"""

from envs.openenv.env import OpenEnvEnv, observation_text, reset_kwargs
from envs.openenv.server import LocalApp, OpenEnvServer, text_field

__all__ = [
    "LocalApp",
    "OpenEnvEnv",
    "OpenEnvServer",
    "observation_text",
    "reset_kwargs",
    "text_field",
]
