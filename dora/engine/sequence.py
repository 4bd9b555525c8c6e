"""One output sequence of the embedded engine: what was asked, what has been sampled so far, and
who to tell. The batcher (batcher.py) owns the sequences it runs; the HTTP server and the control
endpoints hold them to answer, export or abort."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dora.protocol import Completion, FinishReason, SamplingParams


@dataclass(eq=False, kw_only=True)
class Sequence:
    """One output sequence: what was asked, what has been sampled, who to tell."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    key: int
    version: int | None = None
    """Pinned weight version: admission fails if the engine holds another one."""
    listener: Callable[[Sequence], None] | None = None
    """Called on the batcher thread when the sequence finishes (and after each step if `stream`)."""
    stream: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: int = 500
    row: int = -1
    kv_import: torch.Tensor | None = None
    """KV of an imported sequence (prompt + tokens so far but the last), used at admission."""

    def completion(self) -> Completion:
        return Completion(
            request_id=self.id,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason or "abort",
            prompt_tokens=len(self.prompt_ids),
        )
