"""Four games of guess.py on a model, by hand: `python play.py MODEL_DIR` from this folder."""

import asyncio
import sys

from transformers import AutoTokenizer

from dora import EpisodeLimits, PinnedSampler, SamplingParams, Task, load_env, run_group
from dora.engine import EngineClient, EngineServer


async def main(model_dir: str) -> None:
    factory = load_env("guess:GuessEnv", high=100)  # guess.py, imported from the working directory
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with EngineServer.start(model_dir) as server, EngineClient(server.url) as client:
        samples = await run_group(
            sampler=PinnedSampler(client, version=server.version),
            tokenizer=tokenizer,
            env_factory=factory,
            task=Task("game-1"),
            group_size=4,
            params=SamplingParams(max_tokens=64, temperature=1.0),
            limits=EpisodeLimits(max_turns=8, tool_timeout_s=5),
        )
    for s in samples:
        print(s.reward, s.reward_components, s.num_turns, s.finish_reason)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
