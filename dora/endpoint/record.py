"""What an episode's endpoint calls sampled, and the training sample built from it.

Every call of an episode is kept as the exact token ids the engine was prompted with and the
`Completion` it returned (sampled ids, behaviour log-probs, per-token versions). The sample is
built from those ids alone, never from text the agent kept:

- A call whose prompt starts with the previous call's prompt and sampled ids extends the same
  token sequence: the tokens in between (the end of the turn the model did not sample, tool
  results, a user's reply) are context (mask 0, log-prob 0, version -1), the sampled tokens have
  mask 1 and their behaviour log-probs and versions.
- A call whose prompt does not (the agent edited, dropped or summarised its history) starts a new
  segment. One sample holds one token sequence, and concatenating segments would train on a
  context the model never saw, so the sample is the episode's **last** segment; the calls of the
  earlier segments are left out (no gradient) and counted: `history_edits` in the sample's metadata
  and in the step's metrics (`history_edits`), `calls_left_out` beside it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from dora.protocol import Completion, Sample, TokenSequence, check_completion

__all__ = ["Call", "CallRecord", "Trajectory"]


@dataclass(frozen=True)
class Call:
    """One model call of an episode: the prompt ids sent and what came back."""

    prompt_ids: list[int]
    completion: Completion


@dataclass
class Trajectory:
    """The token sequence trained on (one segment of calls)."""

    tokens: TokenSequence = field(default_factory=TokenSequence)
    prompt_len: int = 0
    calls: int = 0

    def add(self, call: Call) -> None:
        """Append `call`, whose prompt starts with the sequence so far: the new prompt tokens as
        context, then the sampled tokens."""
        context = call.prompt_ids[len(self.tokens) :]
        if not self.calls:
            self.prompt_len = len(context)
        self.tokens.add_context(context)
        self.tokens.add_sampled(call.completion)
        self.calls += 1

    def extended_by(self, prompt_ids: list[int]) -> bool:
        n = len(self.tokens)
        return len(prompt_ids) >= n and array("i", prompt_ids[:n]) == self.tokens.ids


@dataclass
class CallRecord:
    """The calls of one episode, in the order they were made, and what the endpoint counted."""

    calls: list[Call] = field(default_factory=list)
    sampled: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Requests answered with an error, by short reason (`wrong model`, `stream`, ...)."""

    def add(self, prompt_ids: list[int], completion: Completion) -> None:
        check_completion(completion)  # refused when it is sampled, not when the episode ends
        self.calls.append(Call(list(prompt_ids), completion))
        self.sampled += len(completion.token_ids)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def segments(self) -> list[Trajectory]:
        """The calls split where a prompt does not extend the sequence so far."""
        segments: list[Trajectory] = []
        for call in self.calls:
            if not segments or not segments[-1].extended_by(call.prompt_ids):
                segments.append(Trajectory())
            segments[-1].add(call)
        return segments

    def metadata(self, segments: list[Trajectory]) -> dict[str, str]:
        """What the sample's metadata says of the endpoint's calls."""
        out = {
            "endpoint_calls": str(len(self.calls)),
            "history_edits": str(max(len(segments) - 1, 0)),
            "calls_left_out": str(sum(s.calls for s in segments[:-1])),
            "tool_errors": str(self.tool_errors),
        }
        for reason, n in sorted(self.refused.items()):
            out[f"refused: {reason}"] = str(n)
        return out

    def to_sample(self, *, reward: float, **fields: object) -> Sample:
        """The sample of the episode: its last segment (see the module docstring)."""
        segments = self.segments()
        last = segments[-1] if segments else Trajectory()
        metadata = {**self.metadata(segments), **dict(fields.pop("metadata", {}))}  # type: ignore[call-overload]
        return last.tokens.to_sample(
            prompt_len=last.prompt_len,
            reward=reward,
            num_turns=len(self.calls),
            num_tool_calls=self.tool_calls,
            metadata=metadata,
            **fields,
        )
