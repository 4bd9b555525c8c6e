"""The check that a sample is token-exact: what a scripted sampler was prompted with and sampled,
call for call."""

from __future__ import annotations

import numpy as np


def check_exact(sample: object, sampler: object) -> None:
    """The sample is the last call's prompt and sampled ids; every call's prompt and sampled ids
    lie in it where they were, the sampled ones (only) with mask 1, their log-probs, version 7."""
    tokens = sample.tokens().tolist()  # type: ignore[attr-defined]
    mask = sample.mask()  # type: ignore[attr-defined]
    assert tokens == sampler.prompts[-1] + sampler.sampled[-1]  # type: ignore[attr-defined]
    expected_mask = np.zeros(len(tokens), dtype=np.uint8)
    for prompt, sampled in zip(sampler.prompts, sampler.sampled, strict=True):  # type: ignore[attr-defined]
        assert tokens[: len(prompt)] == prompt
        assert tokens[len(prompt) : len(prompt) + len(sampled)] == sampled
        expected_mask[len(prompt) : len(prompt) + len(sampled)] = 1
    assert mask.tolist() == expected_mask.tolist()
    logprobs = sample.behaviour_logprobs()  # type: ignore[attr-defined]
    expected = [sampler.logprob(i) for i in range(int(mask.sum()))]  # type: ignore[attr-defined]
    assert np.allclose(logprobs[mask == 1], expected) and not logprobs[mask == 0].any()
    versions = sample.token_versions()  # type: ignore[attr-defined]
    assert set(versions[mask == 1].tolist()) == {7} and set(versions[mask == 0].tolist()) == {-1}
