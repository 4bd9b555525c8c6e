"""The batcher without HTTP: logprobs vs a forward pass, continuous admission, caps, KV moves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.sequence import Sequence
from dora.models.tiny import build_tiny_model
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object]:
    path: Path = build_tiny_model(tmp_path_factory.mktemp("batcher") / "tiny")
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(path)


def make(model_and_tok: tuple[torch.nn.Module, object], **config: int) -> Batcher:
    model, tok = model_and_tok
    return Batcher(
        model, eos_token_ids=[tok.eos_token_id], decode=tok.decode, config=BatcherConfig(**config)
    )  # type: ignore[attr-defined]


def run(b: Batcher, seqs: list[Sequence]) -> None:
    for s in seqs:
        b.add(s)
    while b.has_work():
        b.step()


def test_varied_lengths_match_a_forward_pass(model_and_tok: tuple[torch.nn.Module, object]) -> None:
    b = make(model_and_tok, max_running=5)
    seqs = [
        b.new_sequence(
            f"r{i}",
            list(range(3, 3 + 2 + 5 * i)),
            SamplingParams(max_tokens=10 + 13 * i, seed=i, ignore_eos=True),
        )
        for i in range(12)
    ]
    run(b, seqs)
    model = model_and_tok[0]
    for s in seqs:
        assert s.finish_reason == "length" and len(s.token_ids) == s.params.max_tokens
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.token_ids])).logits[0]
        ref = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1 : -1].gather(
            1, torch.tensor(s.token_ids)[:, None]
        )
        assert (ref[:, 0] - torch.tensor(s.logprobs)).abs().max() < 1e-4
    assert b.running == [] and b.reserved_tokens == 0


def test_seeded_sequence_is_the_same_alone_and_in_a_crowd(
    model_and_tok: tuple[torch.nn.Module, object],
) -> None:
    b = make(model_and_tok)
    params = SamplingParams(max_tokens=30, seed=123, temperature=0.8, top_p=0.9, top_k=20)
    crowd = [
        b.new_sequence(f"c{i}", [4, 5, 6 + i], SamplingParams(max_tokens=5 + i, seed=i))
        for i in range(20)
    ]
    target = b.new_sequence("t", [7, 8, 9], params)
    run(b, [*crowd[:10], target, *crowd[10:]])
    alone = b.new_sequence("a", [7, 8, 9], params)
    run(b, [alone])
    assert alone.token_ids == target.token_ids


def test_caps_bound_running_sequences_and_kv(model_and_tok: tuple[torch.nn.Module, object]) -> None:
    b = make(model_and_tok, max_running=3, max_kv_tokens=100)
    seqs = [
        b.new_sequence(f"r{i}", [5] * 10, SamplingParams(max_tokens=20, ignore_eos=True))
        for i in range(8)
    ]
    for s in seqs:
        b.add(s)
    peak_running = peak_reserved = 0
    while b.has_work():
        b.step()
        peak_running = max(peak_running, len(b.running))
        peak_reserved = max(peak_reserved, b.reserved_tokens)
    assert peak_running == 3 and peak_reserved <= 100
    assert all(len(s.token_ids) == 20 for s in seqs)


def test_a_sequence_ends_at_max_model_len(model_and_tok: tuple[torch.nn.Module, object]) -> None:
    """Prompt and output together never outgrow the model: the answer ends "length" there, and
    rows that ask for less are untouched by their long batch mate."""
    b = make(model_and_tok, max_model_len=40)
    long = b.new_sequence("l", [9] * 10, SamplingParams(max_tokens=100, seed=1, ignore_eos=True))
    short = b.new_sequence("s", [9] * 3, SamplingParams(max_tokens=7, seed=2, ignore_eos=True))
    run(b, [long, short])
    assert (long.finish_reason, len(long.token_ids)) == ("length", 30)
    assert (short.finish_reason, len(short.token_ids)) == ("length", 7)
    assert b.cache.cols_cap <= 41


def test_min_tokens_and_stop_token_ids(model_and_tok: tuple[torch.nn.Module, object]) -> None:
    b = make(model_and_tok)
    probe = b.new_sequence("p", [9, 9], SamplingParams(max_tokens=40, seed=5, ignore_eos=True))
    run(b, [probe])
    stop_at = probe.token_ids[3]
    stopped = b.new_sequence(
        "s",
        [9, 9],
        SamplingParams(max_tokens=40, seed=5, ignore_eos=True, stop_token_ids=[stop_at]),
    )
    run(b, [stopped])
    assert (
        stopped.finish_reason == "stop"
        and stopped.token_ids == probe.token_ids[: probe.token_ids.index(stop_at) + 1]
    )
    late = b.new_sequence(
        "m",
        [9, 9],
        SamplingParams(
            max_tokens=40, seed=5, ignore_eos=True, stop_token_ids=[stop_at], min_tokens=30
        ),
    )
    run(b, [late])
    assert len(late.token_ids) >= 30 and stop_at not in late.token_ids[:30]


def test_detached_kv_resumes_on_another_batcher(
    model_and_tok: tuple[torch.nn.Module, object],
) -> None:
    a, c = make(model_and_tok), make(model_and_tok)
    params = SamplingParams(max_tokens=50, seed=77, ignore_eos=True)
    ref = a.new_sequence("ref", [3, 4, 5, 6], params)
    run(a, [ref])
    moving = a.new_sequence("m", [3, 4, 5, 6], params)
    others = [
        a.new_sequence(f"o{i}", [8] * (i + 1), SamplingParams(max_tokens=60, seed=i))
        for i in range(4)
    ]
    for s in [*others, moving]:
        a.add(s)
    for _ in range(20):
        a.step()
    kv = a.detach(moving)
    assert kv is not None and kv.shape[3] == 4 + len(moving.token_ids) - 1
    moving.finish_reason, moving.kv_import = None, kv
    c.add(moving)
    while c.has_work():
        c.step()
    assert moving.token_ids == ref.token_ids


def test_detaching_a_middle_row_between_steps_keeps_the_others_exact(
    model_and_tok: tuple[torch.nn.Module, object],
) -> None:
    """Export and abort run between steps, outside inference mode, and move the last row's KV
    into the freed one; the moved sequence must continue exactly as it would have."""
    params = [SamplingParams(max_tokens=40, seed=i, ignore_eos=True) for i in range(3)]
    alone = make(model_and_tok)
    refs = [alone.new_sequence(f"r{i}", [5 + i] * 6, p) for i, p in enumerate(params)]
    for ref in refs:
        run(alone, [ref])
    b = make(model_and_tok)
    seqs = [b.new_sequence(f"s{i}", [5 + i] * 6, p) for i, p in enumerate(params)]
    for s in seqs:
        b.add(s)
    for _ in range(10):
        b.step()
    assert b.detach(seqs[0]) is not None  # row 0 of 3: the last row moves into it
    b.abort(seqs[1])
    while b.has_work():
        b.step()
    assert seqs[2].token_ids == refs[2].token_ids


def test_one_long_request_limits_its_batch_mates(
    model_and_tok: tuple[torch.nn.Module, object],
) -> None:
    b = make(model_and_tok, max_kv_tokens=200)
    long = b.new_sequence("long", [5] * 10, SamplingParams(max_tokens=90, ignore_eos=True))
    short = [
        b.new_sequence(f"s{i}", [5] * 10, SamplingParams(max_tokens=5, ignore_eos=True))
        for i in range(6)
    ]
    for s in [long, *short]:
        b.add(s)
    b.step()
    assert len(b.running) == 2 and b.reserved_tokens == 200  # 2 rows x (10 + 90)
    while b.has_work():
        b.step()
        assert b.reserved_tokens <= 200
    assert all(len(s.token_ids) == 5 for s in short) and len(long.token_ids) == 90
    assert b.cache.cols_cap <= b.max_model_len + 1


def test_weights_that_give_nan_end_the_request_with_an_error(tmp_path: Path) -> None:
    """Non-finite logprobs never reach a client: the sequence fails, naming version and token."""
    path = build_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    b = Batcher(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode, version=3)
    seqs = [b.new_sequence(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4)) for i in range(2)]
    run(b, seqs)
    for s in seqs:
        assert s.finish_reason == "error" and s.error_status == 500
        assert s.error is not None and "version 3" in s.error and "non-finite logprob" in s.error
    assert not b.has_work()
