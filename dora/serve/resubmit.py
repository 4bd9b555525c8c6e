"""One completion out of as many calls as it takes: the loop an episode's sampler runs.

A call can end interrupted: the router moved its lease (abort, or export with the KV cache) or
its instance was lost. The loop then continues: it imports the export (no re-prefill), or calls
again with the prompt plus the tokens so far and the remaining token budget, until the
completion ends on its own. The caller sees one completion. The loop is the same whether the
calls are made in serve (`router.LeaseSampler`) or by an episode runner (`runner_episodes`):
only `call_once` differs.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from dora.errors import RequestError
from dora.instance import ExportedRequest, InstanceClient
from dora.protocol import Completion, FinishReason, SamplingParams, as_array, extend_array
from dora.serve.stats import ServeStats
from dora.serve.turns import Turns

__all__ = ["CallOnce", "complete_calls", "generate"]

log = logging.getLogger("dora.serve")

CallOnce = Callable[
    [Sequence[int], SamplingParams, ExportedRequest | None],
    Awaitable[tuple[Completion, ExportedRequest | None, bool]],
]
"""One call: (prompt, params, the export to import) -> (completion, export, interrupted?)."""


async def complete_calls(
    call_once: CallOnce,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    name: str,
    version: Callable[[], int],
    turns: Turns,
    stats: ServeStats,
) -> Completion:
    """Call until the completion ends (see the module docstring); `name` names it in logs and
    as the request id, `version()` is its lease's version now (an export of another version is
    resubmitted, not imported)."""
    # The prompt as a typed array from here on (the episode runner's already is): a list given
    # is freed now instead of being walked by every collection while the call is in flight.
    prompt = as_array("i", prompt_ids)
    del prompt_ids
    # What the calls so far sampled, in typed arrays: the episode waits for its loop turn
    # holding them, and each garbage collection walks every item of a list it finds (at 128
    # instances, answers of up to 30,000 tokens waiting made most of a collection's work).
    sampled = _Sampled()
    imported: ExportedRequest | None = None
    finish: FinishReason
    while True:
        # An interrupted call is continued: the next call's prompt ends with its tokens.
        left = params.max_tokens - len(sampled.tokens)
        if left <= 0:
            finish = "length"
            break
        await turns.take()  # building and sending the request: one stretch among many
        try:
            part, exported, interrupted = await call_once(
                prompt + sampled.tokens if sampled.tokens else prompt,
                msgspec.structs.replace(params, max_tokens=left),
                imported,
            )
        except RequestError as exc:
            # The instance refused this request as malformed (e.g. too long for it): the
            # episode ends with "error" and the runner masks its sample; the run goes on.
            log.warning("request of episode %s refused: %s", name, exc)
            finish = "error"
            break
        done = len(imported.token_ids) if imported is not None else 0
        imported = None
        if exported is not None and exported.kv and exported.version == version():
            # KV migration (not to another version: partial mode resubmits). The export
            # holds this call's tokens; the next call imports them and continues.
            sampled.add(exported.token_ids, exported.logprobs, exported.versions, done)
            imported = exported
        else:
            sampled.add(part.token_ids, part.logprobs, part.versions, done)
            finish = part.finish_reason
        del part, exported
        await turns.take()  # the answers of many instances arrive in one loop iteration
        if imported is not None:
            continue
        if not interrupted:
            break
        stats.resubmissions += 1
    return Completion(
        request_id=name,
        token_ids=sampled.tokens,
        logprobs=sampled.logprobs,
        versions=sampled.versions,
        finish_reason=finish,
        prompt_tokens=len(prompt),
    )


async def generate(
    client: InstanceClient,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    request_id: str,
    version: int | None,
    session: str | None,
) -> Completion:
    """One generate on `client`, naming the episode's session where there is one (a client of an
    instance without sessions is never given the argument)."""
    if session is None:
        return await client.generate(prompt_ids, params, request_id=request_id, version=version)
    return await client.generate(
        prompt_ids, params, request_id=request_id, version=version, session=session
    )


class _Sampled:
    """The tokens, behaviour log-probs and versions an episode's call has sampled so far."""

    def __init__(self) -> None:
        self.tokens = array("i")
        self.logprobs = array("f")
        self.versions = array("i")

    def add(
        self, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], skip: int
    ) -> None:
        """Append a call's tokens, log-probs and versions after the first `skip` (already here)."""
        if skip:
            tokens, logprobs, versions = tokens[skip:], logprobs[skip:], versions[skip:]
        extend_array(self.tokens, tokens)
        extend_array(self.logprobs, logprobs)
        extend_array(self.versions, versions)
