"""The natural-language-assertion judge: tau2's prompt, sent to a configured chat endpoint.

tau2's own judge (`evaluator_nl_assertions`) calls litellm with a hard-coded `gpt-4.1`; dora never
imports litellm, so this sends the same instructions to an OpenAI-compatible endpoint of the user's
choice. An answer that is not the expected JSON raises `EnvError` (the episode is masked: a broken
judge says nothing about the policy).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dora import EnvError
from envs.tau2.chat import ChatEndpoint

if TYPE_CHECKING:
    from tau2.data_model.message import Message as Tau2Message

# The instructions of tau2's NLAssertionsEvaluator (MIT, Sierra Research), unchanged in substance.
SYSTEM_PROMPT = """TASK
- You will be given a list of expected outcomes and a conversation that was collected during a test case run.
- The conversation is between an agent and a customer.
- Your job is to evaluate whether the agent satisfies each of the expected outcomes.
- Grade each expected outcome individually.

FORMAT
- Your response should be a JSON object with the following fields:
- `reasoning`: a short explanation for your classification
- `metExpectation`: `true` if the agent satisfies the expected outcomes, `false` otherwise
- `expectedOutcome`: repeat the expectation from the input that you are grading

Example response structure:
{
    "results": [
        {
            "expectedOutcome": "<one of the expected outcomes from the input>",
            "reasoning": "<reasoning trace>",
            "metExpectation": <false or true>
        }
    ]
}"""  # noqa: E501

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


async def judge_nl_assertions(
    endpoint: ChatEndpoint, trajectory: Sequence[Tau2Message], assertions: Sequence[str]
) -> list[bool]:
    """Whether the conversation meets each assertion, in order."""
    conversation = "\n".join(f"{m.role}: {m.content}" for m in trajectory)
    user = f"conversation:\n{conversation}\n\nexpectedOutcomes:\n{list(assertions)}"
    reply = await endpoint.complete(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    )
    text = str(reply.get("content", ""))
    fenced = _FENCE.search(text)
    try:
        data = json.loads(fenced.group(1) if fenced else text)
        results = data["results"]
        verdicts = {str(r["expectedOutcome"]).strip(): bool(r["metExpectation"]) for r in results}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise EnvError(
            f"the NL-assertion judge did not answer the expected JSON: {text[:300]!r}"
        ) from exc
    if all(a.strip() in verdicts for a in assertions):
        return [verdicts[a.strip()] for a in assertions]
    if len(results) == len(assertions):
        return [bool(r["metExpectation"]) for r in results]
    raise EnvError(
        f"the NL-assertion judge graded {len(results)} outcome(s), expected {len(assertions)}"
    )
