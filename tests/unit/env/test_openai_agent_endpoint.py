"""An agent's own loop with the `openai` client against the endpoint of its episode: the sample is
the exact ids the sampler was prompted with and sampled, call for call; edited history, bad
requests and failing agents are counted outcomes, never a crash."""

from __future__ import annotations

import json
import math

import pytest

from dora.endpoint import agent_env
from dora.env import Task
from dora.episode import EpisodeLimits, run_episode
from dora.errors import ServerError
from dora.protocol import SamplingParams
from dora.render import ChatRenderer
from tests.unit.env.exact import check_exact

openai = pytest.importorskip("openai")

PARAMS = SamplingParams(max_tokens=200, temperature=1.0)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'


async def tool_agent(base_url: str, model: str, task: Task) -> float:
    """A plain tool loop, as a user writes it with the openai client."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": str(task["question"])},
    ]
    async with client:
        for _ in range(4):
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, temperature=0.7
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return 1.0 if "5" in (message.content or "") else 0.0
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                result = str(args["a"] + args["b"])
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


async def run(sampler: object, fn: object, tokenizer: object, **limits: object) -> object:
    env = agent_env(fn)()  # type: ignore[arg-type]
    return await run_episode(
        sampler=sampler,  # type: ignore[arg-type]
        tokenizer=tokenizer,  # type: ignore[arg-type]
        env=env,
        task=Task("p0", {"question": "What is 2 + 3?"}),
        params=PARAMS,
        limits=EpisodeLimits(**limits),  # type: ignore[arg-type]
    )


async def test_openai_agent_tool_loop_trains_on_exactly_what_was_sampled(
    scripted, tokenizer
) -> None:
    sampler = scripted([CALL, "It is 5.<|im_end|>"])
    sample = await run(sampler, tool_agent, tokenizer)
    assert not sample.masked, sample.metadata
    assert sample.reward == 1.0 and sample.num_turns == 2 and sample.num_tool_calls == 1
    assert sample.metadata["history_edits"] == "0" and sample.metadata["endpoint_calls"] == "2"
    check_exact(sample, sampler)
    # the second prompt went on from the first call's ids: the tool result rendered as the
    # runner renders it, equal to the chat template's rendering of the whole conversation
    renderer = ChatRenderer(tokenizer)  # type: ignore[arg-type]
    conversation = [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": CALL.removesuffix("<|im_end|>")},
        {"role": "tool", "content": "5", "tool_call_id": "x"},
    ]
    assert sampler.prompts[1] == renderer.prompt_ids(conversation, TOOLS)  # type: ignore[arg-type]
    assert sampler.params[0].temperature == 1.0  # the run's sampling, not the agent's 0.7


async def test_openai_agent_edited_history_trains_on_the_last_segment(scripted, tokenizer) -> None:
    async def forgetful(base_url: str, model: str, task: Task) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        async with client:
            for question in ("first", "second"):
                messages = [{"role": "user", "content": question}]
                await client.chat.completions.create(model=model, messages=messages)
        return 0.5

    sampler = scripted(["a<|im_end|>", "b<|im_end|>"])
    sample = await run(sampler, forgetful, tokenizer)
    assert not sample.masked and sample.reward == 0.5
    assert sample.metadata["history_edits"] == "1" and sample.metadata["calls_left_out"] == "1"
    assert sample.tokens().tolist() == sampler.prompts[1] + sampler.sampled[1]
    assert sample.prompt_len == len(sampler.prompts[1])


async def test_openai_agent_completions_text_continues_the_ids(scripted, tokenizer) -> None:
    async def writer(base_url: str, model: str, task: Task) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        async with client:
            text = "Q: 2+3\nA:"
            first = await client.completions.create(model=model, prompt=text, max_tokens=8)
            text += first.choices[0].text + "\nQ: again\nA:"
            await client.completions.create(model=model, prompt=text, max_tokens=8)
        return 1.0

    sampler = scripted([" 5", " 5"])
    sample = await run(sampler, writer, tokenizer)
    assert not sample.masked and sample.metadata["history_edits"] == "0"
    check_exact(sample, sampler)
    assert sampler.params[0].max_tokens == 8


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("wrong model", "agent raised NotFoundError"),
        ("stream", "agent raised BadRequestError"),
        ("no call", "agent made no model call"),
        ("raises", "agent raised RuntimeError"),
        ("nan", "reward returned"),
        ("text reward", "reward returned"),
    ],
)
async def test_openai_agent_bad_input_masks_with_a_reason(
    scripted, tokenizer, case: str, reason: str
) -> None:
    async def agent(base_url: str, model: str, task: Task) -> object:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        async with client:
            messages = [{"role": "user", "content": "hi"}]
            if case == "no call":
                return 1.0
            if case in ("wrong model", "stream"):
                name = "gpt-4o" if case == "wrong model" else model
                await client.chat.completions.create(
                    model=name, messages=messages, stream=case == "stream"
                )
            await client.chat.completions.create(model=model, messages=messages)
            if case == "raises":
                raise RuntimeError("the agent broke")
            return math.nan if case == "nan" else "1.0"

    sample = await run(scripted(["ok<|im_end|>"]), agent, tokenizer)
    assert sample.masked and sample.metadata["error"].startswith(reason), sample.metadata
    if case in ("wrong model", "stream"):
        assert sample.metadata[f"refused: {case}"] == "1"


async def test_openai_agent_malformed_tool_call_is_the_models_text(scripted, tokenizer) -> None:
    seen: list[object] = []

    async def agent(base_url: str, model: str, task: Task) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        async with client:
            messages = [{"role": "user", "content": "add"}]
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS
            )
        seen.append(response.choices[0].message)
        return 0.0

    sampler = scripted(["<tool_call>{not json</tool_call><|im_end|>"])
    sample = await run(sampler, agent, tokenizer)
    assert not sample.masked and sample.metadata["tool_errors"] == "1"
    message = seen[0]
    assert message.tool_calls is None  # type: ignore[attr-defined]
    assert message.content == "<tool_call>{not json</tool_call>"  # type: ignore[attr-defined]


async def test_openai_agent_limits_and_late_calls_are_refused(scripted, tokenizer) -> None:
    urls: list[str] = []
    statuses: list[int] = []

    async def greedy(base_url: str, model: str, task: Task) -> float:
        urls.append(base_url)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "go"}]
        async with client:
            for _ in range(3):
                try:
                    await client.chat.completions.create(model=model, messages=messages)
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)
        return 1.0

    sample = await run(scripted(["x<|im_end|>"]), greedy, tokenizer, max_turns=2)
    assert statuses == [400] and sample.finish_reason == "max_turns"
    assert sample.metadata["refused: max turns"] == "1" and sample.num_turns == 2
    late = openai.AsyncOpenAI(base_url=urls[0], api_key="none", max_retries=0)
    async with late:
        with pytest.raises(openai.APIStatusError) as caught:
            await late.chat.completions.create(model="policy", messages=[])
    assert caught.value.status_code == 410


async def test_openai_agent_sync_function_runs_off_the_loop(scripted, tokenizer) -> None:
    def sync_agent(base_url: str, model: str, task: Task, *, bonus: float) -> dict[str, float]:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        with client:
            response = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
        return {"said": float(response.choices[0].message.content == "ok"), "bonus": bonus}

    env = agent_env(sync_agent)(bonus=0.25)
    sampler = scripted(["ok<|im_end|>"])
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=env, task=Task("p"), params=PARAMS
    )
    assert not sample.masked and sample.reward == 1.25
    assert sample.reward_components == {"said": 1.0, "bonus": 0.25}
    check_exact(sample, sampler)


async def test_openai_agent_sampler_failure_propagates_as_in_the_runner(tokenizer) -> None:
    class Dead:
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> object:
            raise ServerError("the instance is gone")

    async def agent(base_url: str, model: str, task: Task) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        async with client:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
        return 1.0

    with pytest.raises(ServerError, match="the instance is gone"):
        await run(Dead(), agent, tokenizer)


async def test_openai_agent_token_budget_cuts_a_call_then_refuses(scripted, tokenizer) -> None:
    finishes: list[str] = []
    statuses: list[int] = []

    async def talker(base_url: str, model: str, task: Task) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        async with client:
            for _ in range(2):
                try:
                    response = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "talk"}]
                    )
                    finishes.append(response.choices[0].finish_reason)
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)
        return 0.0

    sampler = scripted(["a long answer that goes on<|im_end|>"])
    sample = await run(sampler, talker, tokenizer, max_total_tokens=10)
    assert sampler.params[0].max_tokens == 10 and finishes == ["length"] and statuses == [400]
    assert sample.finish_reason == "length" and sample.metadata["refused: length"] == "1"
    assert int(sample.mask().sum()) == 10
