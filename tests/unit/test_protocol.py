"""Wire types round-trip exactly, carry arrays as raw bytes, and reject malformed frames."""

from __future__ import annotations

import numpy as np
import pytest

from dora.bench.protocol import make_group
from dora.errors import ProtocolError
from dora.protocol import (
    Assigned,
    Completion,
    Durable,
    Sample,
    StepDone,
    WeightsReady,
    decode_from_learn,
    decode_from_serve,
    encode,
)


def test_group_round_trips_bit_exactly() -> None:
    group = make_group(samples=4, tokens=300, seed=1)
    back = decode_from_serve(encode(Assigned(step=3, group=group)))
    assert isinstance(back, Assigned)
    assert back.step == 3
    assert back.group == group
    original, decoded = group.samples[2], back.group.samples[2]
    np.testing.assert_array_equal(decoded.tokens(), original.tokens())
    np.testing.assert_array_equal(decoded.behaviour_logprobs(), original.behaviour_logprobs())
    assert decoded.reward_components == {"correct": 0.0}


def test_arrays_travel_as_raw_bytes_not_int_lists() -> None:
    group = make_group(samples=1, tokens=4096)
    frame = encode(Assigned(step=0, group=group))
    # 4096 tokens x (4 + 1 + 4 + 4) bytes plus a small header: no per-int msgpack encoding
    assert 4096 * 13 <= len(frame) < 4096 * 13 + 512


def test_sample_build_checks_lengths_and_views_dtypes() -> None:
    sample = Sample.build(
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -1.5],
        versions=[-1, 2, 2],
        prompt_len=1,
        reward=1.0,
    )
    assert len(sample) == 3
    assert sample.tokens().dtype == np.int32 and sample.tokens().tolist() == [1, 2, 3]
    assert sample.mask().tolist() == [0, 1, 1]
    assert sample.token_versions().tolist() == [-1, 2, 2]
    with pytest.raises(ValueError, match="differ in length"):
        Sample.build(
            token_ids=[1, 2],
            loss_mask=[1],
            logprobs=[0.0, 0.0],
            versions=[0, 0],
            prompt_len=0,
            reward=0.0,
        )


@pytest.mark.parametrize(
    "message",
    [
        StepDone(step=4, incarnation=1, metrics={"loss": 0.5}),
        Durable(step=4, incarnation=1),
        WeightsReady(version=5, incarnation=1, path="/tmp/w5"),
    ],
)
def test_control_messages_round_trip(message: object) -> None:
    assert decode_from_learn(encode(message)) == message  # type: ignore[arg-type]


def test_malformed_frames_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="from dora serve"):
        decode_from_serve(b"\x93garbage")
    with pytest.raises(ProtocolError):
        decode_from_learn(encode(Assigned(step=0, group=make_group(samples=1, tokens=8))))


def test_completion_version_is_first_token_version() -> None:
    c = Completion(
        request_id="r",
        token_ids=[5, 6],
        logprobs=[-1.0, -2.0],
        versions=[3, 4],
        finish_reason="length",
    )
    assert c.version == 3
    empty = Completion(
        request_id="r", token_ids=[], logprobs=[], versions=[], finish_reason="abort"
    )
    assert empty.version == -1


def test_version_spans_are_the_runs_of_the_sampled_tokens() -> None:
    # prompt (2 tokens, -1), 3 tokens of version 4, an environment token (-1), 2 tokens of 5 and 1
    # of 4: spans are half-open [start, end) over positions, merged across unsampled tokens
    versions = [-1, -1, 4, 4, 4, -1, 5, 5, 4]
    sample = Sample.build(
        token_ids=list(range(9)),
        loss_mask=[0 if v < 0 else 1 for v in versions],
        logprobs=[0.0] * 9,
        versions=versions,
        prompt_len=2,
        reward=0.0,
    )
    assert sample.version_spans() == [(2, 6, 4), (6, 8, 5), (8, 9, 4)]
    assert (
        Sample.build(
            token_ids=[1], loss_mask=[0], logprobs=[0.0], versions=[-1], prompt_len=1, reward=0.0
        ).version_spans()
        == []
    )
