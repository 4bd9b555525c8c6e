"""The fused decode step and prefix-shared prefill: the same tokens and logprobs as HF's modules."""

from __future__ import annotations

import pytest
import torch
from tiny_lm import small_lm

from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.fused import supported
from dora.engine.sequence import Sequence
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(120)

EOS = 2


def _model(arch: str, **extra: object) -> torch.nn.Module:
    return small_lm(arch, **extra)


def _batcher(model: torch.nn.Module, *, fused: bool) -> Batcher:
    return Batcher(
        model,
        eos_token_ids=[EOS],
        decode=lambda ids: "".join(chr(65 + i % 26) for i in ids),
        config=BatcherConfig(max_running=8, fused_decode=fused),
    )


def _run(b: Batcher, n: int = 10) -> list[Sequence]:
    seqs = [
        b.new_sequence(
            f"r{i}",
            list(range(3, 6 + 3 * (i % 4))),  # groups of equal prompts, and varied lengths
            SamplingParams(max_tokens=12 + 5 * i, seed=i, temperature=0.9, ignore_eos=True),
        )
        for i in range(n)
    ]
    for s in seqs:
        b.add(s)
    while b.has_work():
        b.step()
    return seqs


def _reference_logprobs(model: torch.nn.Module, seq: Sequence) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq.prompt_ids + seq.token_ids])).logits[0]
    scaled = torch.log_softmax(logits / seq.params.temperature, -1)
    return scaled[len(seq.prompt_ids) - 1 : -1].gather(1, torch.tensor(seq.token_ids)[:, None])[
        :, 0
    ]


@pytest.mark.parametrize(
    ("arch", "extra"),
    [("llama", {}), ("qwen2", {}), ("llama", {"num_key_value_heads": 2})],
    ids=["llama", "qwen2-biases", "llama-gqa"],
)
def test_fused_decode_samples_what_hf_modules_sample(arch: str, extra: dict[str, object]) -> None:
    model = _model(arch, **extra)
    fused, plain = _batcher(model, fused=True), _batcher(model, fused=False)
    assert fused._fused is not None and plain._fused is None
    a, b = _run(fused), _run(plain)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5
        ref = _reference_logprobs(model, x)  # the trainer's forward pass
        assert (ref - torch.tensor(x.logprobs)).abs().max() < 1e-4


def test_weights_copied_in_place_reach_the_fused_step() -> None:
    model = _model("llama")
    b = _batcher(model, fused=True)
    _run(b, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # what a weight load does: in-place copies into the same tensors
    [seq] = _run(b, 1)
    ref = _reference_logprobs(model, seq)
    assert (ref - torch.tensor(seq.logprobs)).abs().max() < 1e-4


def test_more_rows_than_positions_decode_together() -> None:
    """A short max_model_len and many running rows: every row still decodes in the fused step,
    with the tokens the HF modules give."""
    model = _model("llama")

    def run(fused: bool) -> list[Sequence]:
        b = Batcher(
            model,
            eos_token_ids=[EOS],
            decode=lambda ids: "",
            config=BatcherConfig(max_running=32, max_model_len=12, fused_decode=fused),
        )
        seqs = [
            b.new_sequence(
                f"r{i}", [3 + i % 5, 4], SamplingParams(max_tokens=8, seed=i, ignore_eos=True)
            )
            for i in range(24)
        ]
        b.add_all(seqs)
        b.step()
        assert len(b.running) == 24
        while b.has_work():
            b.step()
        return seqs

    fused, plain = run(True), run(False)
    assert [s.token_ids for s in fused] == [s.token_ids for s in plain]
    assert all(len(s.token_ids) == 8 for s in fused)


def test_a_groups_prompt_is_prefilled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama")
    b = _batcher(model, fused=True)
    widths: list[tuple[int, int]] = []
    forward = b._forward

    def counting(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        widths.append(tuple(ids.shape))  # type: ignore[arg-type]
        return forward(ids, mask, positions)

    monkeypatch.setattr(b, "_forward", counting)
    seqs = _run(b, 8)  # 8 sequences, 4 distinct prompts, admitted in one step
    assert widths == [(4, 3 + 3 * 3)]  # only the prefill calls _forward: the fused path decodes
    for s in seqs:
        ref = _reference_logprobs(model, s)
        assert (ref - torch.tensor(s.logprobs)).abs().max() < 1e-4
    same = [s for s in seqs if s.prompt_ids == seqs[0].prompt_ids]
    assert len(same) == 2 and same[0].token_ids != same[1].token_ids  # own seeds, own samples


def test_other_architectures_decode_through_hf_modules() -> None:
    model = _model("llama", hidden_act="gelu")
    assert supported(model) == "hidden_act 'gelu'"
    assert _batcher(model, fused=True)._fused is None
