"""Plain-text prompts on a base model's tokenizer (no chat template, `<s>` added by its
post-processor): no chat template is needed, the prompt becomes exactly `tokenizer(prompt)`'s ids
(or, with special tokens turned off, `tokenizer(prompt, add_special_tokens=False)`'s), an env with
only `reset` and `reward` works for plain text and for chat, and a chat prompt on a template-less
tokenizer is a clear error that names the model folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.data import fit_context
from dora.env import Env, Episode, Message, Task
from dora.episode import ChatRenderer, run_episode
from dora.errors import ConfigError
from dora.models.tiny import BOS, char_tokenizer
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(30)

PARAMS = SamplingParams(max_tokens=50)
TASK = Task("t0", {"question": "2+2=", "answer": "4"})


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The base tokenizer as `from_pretrained` gives it (it knows its folder)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("base-model")
    char_tokenizer(base=True).save_pretrained(folder)  # type: ignore[attr-defined]
    return AutoTokenizer.from_pretrained(folder)


class PlainEnv(Env):
    """Only `reset` (plain text) and `reward`: the default `step` ends the episode."""

    def reset(self, task: Task) -> str:
        return f"Q: {task['question']}\nA:"

    def reward(self, episode: Episode) -> float:
        return 1.0 if episode.completion.strip() == task_answer(episode) else 0.0


class ChatOnlyEnv(Env):
    """Only `reset` (chat messages) and `reward`."""

    def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": str(task["question"])}]

    def reward(self, episode: Episode) -> float:
        return 1.0 if task_answer(episode) in episode.completion else 0.0


def task_answer(episode: Episode) -> str:
    return str(episode.task["answer"])


def test_the_base_tokenizer_adds_bos_and_has_no_chat_template(base_tokenizer) -> None:
    assert base_tokenizer.chat_template is None
    assert (Path(base_tokenizer.name_or_path) / "tokenizer.json").is_file()
    ids = base_tokenizer("ab").input_ids
    assert ids[0] == base_tokenizer.convert_tokens_to_ids(BOS) and len(ids) == 3


async def test_a_plain_text_episode_needs_no_chat_template_and_keeps_special_tokens(
    base_tokenizer, scripted
) -> None:
    sampler = scripted([" 4"])
    renderer = ChatRenderer(base_tokenizer)  # no template: must not fail
    sample = await run_episode(
        sampler=sampler, tokenizer=renderer, env=PlainEnv(), task=TASK, params=PARAMS
    )
    expected = list(base_tokenizer("Q: 2+2=\nA:").input_ids)
    assert expected[0] == base_tokenizer.bos_token_id
    assert sampler.prompts[0] == expected
    assert sample.tokens().tolist()[: sample.prompt_len] == expected
    assert not sample.masked, sample.metadata
    assert (sample.finish_reason, sample.reward) == ("stop", 1.0)


async def test_special_tokens_can_be_turned_off(base_tokenizer, scripted) -> None:
    sampler = scripted([" 4"])
    renderer = ChatRenderer(base_tokenizer, add_special_tokens=False)
    await run_episode(sampler=sampler, tokenizer=renderer, env=PlainEnv(), task=TASK, params=PARAMS)
    assert sampler.prompts[0] == base_tokenizer("Q: 2+2=\nA:", add_special_tokens=False).input_ids


async def test_reset_and_reward_alone_work_for_plain_text(tokenizer, scripted) -> None:
    sample = await run_episode(
        sampler=scripted([" 4"]), tokenizer=tokenizer, env=PlainEnv(), task=TASK, params=PARAMS
    )
    assert not sample.masked, sample.metadata
    assert (sample.finish_reason, sample.reward, sample.num_turns) == ("stop", 1.0, 1)


async def test_reset_and_reward_alone_work_for_chat_too(tokenizer, scripted) -> None:
    sampler = scripted(["it is 4<|im_end|>"])
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=ChatOnlyEnv(), task=TASK, params=PARAMS
    )
    assert not sample.masked, sample.metadata
    assert (sample.finish_reason, sample.reward, sample.num_turns) == ("stop", 1.0, 1)


async def test_a_chat_prompt_without_a_chat_template_names_the_model_folder(
    base_tokenizer, scripted
) -> None:
    folder = str(base_tokenizer.name_or_path)
    renderer = ChatRenderer(base_tokenizer)
    with pytest.raises(ConfigError, match="chat template") as info:
        renderer.prompt_ids([{"role": "user", "content": "hi"}], [])
    assert folder in str(info.value)
    # at start, where serve measures every prompt: the error stops it, it is not a skipped row
    with pytest.raises(ConfigError, match="chat template") as info:
        await fit_context([TASK], env_factory=ChatOnlyEnv, renderer=renderer, context_limit=1024)
    assert folder in str(info.value) and "plain" in str(info.value)
    # plain text measures as the episode tokenizes it, special tokens included
    fitted = await fit_context([TASK], env_factory=PlainEnv, renderer=renderer, context_limit=12)
    assert [t.prompt_id for t in fitted.tasks] == ["t0"]  # 11 tokens with <s>
    with pytest.raises(Exception, match="do not fit"):
        await fit_context([TASK], env_factory=PlainEnv, renderer=renderer, context_limit=11)
