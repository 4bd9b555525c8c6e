"""LoRA versions in the engine: rows of several adapter versions decode in one batch exactly as
each version alone, and as the trainer's peft model computes them."""

from __future__ import annotations

import copy

import pytest
import torch

from dora.config_sections import LoraSettings
from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.sequence import Sequence
from dora.learn.lora import adapter_tensors, apply_lora
from dora.protocol import SamplingParams
from tests.unit.engine.test_fused import _model as fused_model

pytestmark = pytest.mark.timeout(180)

EOS = 2
VERSIONS = (1, 2, 3)


def _model(arch: str) -> torch.nn.Module:
    return fused_model(arch, num_key_value_heads=2)


class Versions:
    """A peft copy of the base with one trained-looking adapter per version."""

    def __init__(self, base: torch.nn.Module, targets: list[str]) -> None:
        settings = LoraSettings(rank=4, alpha=8, target_modules=targets)
        self.peft = apply_lora(copy.deepcopy(base), settings).eval()
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        for v in VERSIONS:
            gen = torch.Generator().manual_seed(100 + v)
            state = {
                name: torch.randn(p.shape, generator=gen) * 0.3
                for name, p in self.peft.named_parameters()
                if "lora_" in name
            }
            self.states[v] = state
            self.use(v)
            self.published[v] = adapter_tensors(self.peft, self.peft.state_dict())

    def use(self, version: int) -> None:
        with torch.no_grad():
            params = dict(self.peft.named_parameters())
            for name, value in self.states[version or VERSIONS[0]].items():
                params[name].copy_(value if version else torch.zeros_like(value))  # 0: the base

    def logprobs(self, version: int, seq: Sequence) -> torch.Tensor:
        """What the trainer recomputes: the peft model's forward at the sampling temperature."""
        self.use(version)
        with torch.no_grad():
            ids = torch.tensor([seq.prompt_ids + seq.token_ids])
            logits = self.peft(input_ids=ids).logits[0]
        scaled = torch.log_softmax(logits / seq.params.temperature, -1)
        start = len(seq.prompt_ids) - 1
        return scaled[start:-1].gather(1, torch.tensor(seq.token_ids)[:, None])[:, 0]


def _batcher(model: torch.nn.Module, versions: Versions, *, fused: bool) -> Batcher:
    b = Batcher(
        model,
        eos_token_ids=[EOS],
        decode=lambda ids: "".join(chr(65 + i % 26) for i in ids),
        config=BatcherConfig(max_running=16, fused_decode=fused),
    )
    for v in VERSIONS:
        b.load_adapter(v, versions.published[v], keep=False)
    return b


def _sequences(b: Batcher, versions: list[int]) -> list[Sequence]:
    seqs = []
    for i, v in enumerate(versions):
        seqs.append(
            b.new_sequence(
                f"v{v}-r{i}",
                [3 + i % 3, 5, 7, 11, 13][: 3 + i % 3],  # equal prompts across versions too
                SamplingParams(max_tokens=10 + 3 * i, seed=i, temperature=0.9, ignore_eos=True),
                version=v,
            )
        )
    return seqs


def _run(b: Batcher, seqs: list[Sequence]) -> None:
    b.add_all(seqs)
    while b.has_work():
        b.step()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hf"])
@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        ("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("qwen2", ["q_proj", "v_proj", "down_proj"]),  # biases, and groups partly targeted
    ],
    ids=["llama-all", "qwen2-some"],
)
def test_rows_of_three_adapter_versions_in_one_batch_match_each_alone(
    arch: str, targets: list[str], fused: bool
) -> None:
    base = _model(arch)
    versions = Versions(base, targets)
    mixed = _batcher(base, versions, fused=fused)
    assert (mixed._fused is not None) == fused
    assert mixed.held_versions() == [0, 1, 2, 3]
    order = [1, 2, 3, 0, 3, 2, 1, 1, 3, 2, 0, 2]
    together = _sequences(mixed, order)
    _run(mixed, together)
    steps_alone = 0
    for v in (0, *VERSIONS):
        alone_b = _batcher(base, versions, fused=fused)
        mine = [i for i, x in enumerate(order) if x == v]
        alone = _sequences(alone_b, order)
        _run(alone_b, [alone[i] for i in mine])
        for i in mine:
            a, t = alone[i], together[i]
            assert a.token_ids == t.token_ids, (v, i)
            assert t.versions == [v] * len(t.token_ids)
            torch.testing.assert_close(
                torch.tensor(t.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0
            )
            # the trainer's recomputation (peft) gives the behaviour logprobs
            torch.testing.assert_close(
                torch.tensor(t.logprobs), versions.logprobs(v, t), atol=1e-4, rtol=0
            )
            steps_alone += 1
    assert steps_alone == len(order)
    # the versions really differ: the same seed and prompt sample other tokens per version
    firsts = {tuple(together[i].token_ids) for i in (0, 1, 2, 3)}
    assert len(firsts) > 1


def test_fused_and_hf_paths_agree_under_adapters() -> None:
    base = _model("llama")
    versions = Versions(base, ["q_proj", "o_proj", "up_proj"])
    order = [3, 1, 2, 0, 2, 3]
    a_b, b_b = _batcher(base, versions, fused=True), _batcher(base, versions, fused=False)
    a, b = _sequences(a_b, order), _sequences(b_b, order)
    _run(a_b, a)
    _run(b_b, b)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0
        )


def test_load_keep_moves_unpinned_rows_and_unload_is_refused_while_needed() -> None:
    base = _model("llama")
    versions = Versions(base, ["q_proj", "v_proj"])
    b = Batcher(
        base,
        eos_token_ids=[EOS],
        decode=lambda ids: "".join(chr(65 + i % 26) for i in ids),
        config=BatcherConfig(max_running=8),
    )
    b.load_adapter(1, versions.published[1], keep=False)
    params = SamplingParams(max_tokens=8, seed=0, ignore_eos=True)
    free = b.new_sequence("free", [3, 4, 5], params)
    pinned = b.new_sequence("pinned", [3, 4, 5], params, version=1)
    stays = b.new_sequence("stays", [3, 4, 5], params, version=0)
    b.add_all([free, pinned, stays])
    b.step()
    b.step()
    with pytest.raises(ValueError, match="newest"):
        b.unload_adapter(1)
    before = len(free.token_ids)
    assert before >= 2
    b.load_adapter(2, versions.published[2], keep=False)
    with pytest.raises(ValueError, match="still used"):
        b.unload_adapter(1)
    b.step()
    assert free.versions == pinned.versions == [1] * (before + 1)  # a load leaves rows alone
    assert stays.versions == [0] * (before + 1)
    b.load_adapter(3, versions.published[3], keep=True)
    while b.has_work():
        b.step()
    # partial rollout, as with full weights: every running row samples the newest from then on
    for seq in (free, pinned):
        assert seq.versions == [1] * (before + 1) + [3] * (7 - before)
    assert stays.versions == [0] * (before + 1) + [3] * (7 - before)
    b.unload_adapter(1)
    b.unload_adapter(2)
    assert b.held_versions() == [0, 3]
    with pytest.raises(KeyError):
        b.unload_adapter(1)
    late = b.new_sequence("late", [3, 4], params, version=1)
    b.add(late)
    b.step()
    assert late.error_status == 409 and "holds 0, 3" in (late.error or "")
    # a freed slot is reused, and an adapter of another shape is refused, changing nothing
    b.load_adapter(4, versions.published[1], keep=False)
    assert b.adapters.slot_of == {3: 3, 4: 1}
    wrong = {k: v for k, v in versions.published[3].items() if "v_proj" not in k}
    with pytest.raises(ValueError, match="same"):
        b.load_adapter(5, wrong, keep=False)
    assert b.held_versions() == [0, 3, 4] and b.version == 4


def test_a_full_weight_load_drops_the_adapters() -> None:
    base = _model("llama")
    versions = Versions(base, ["q_proj"])
    b = _batcher(base, versions, fused=True)
    b.load_base(7)
    assert b.held_versions() == [7] and b.version == 7 and not b.adapters.slot_of


def test_beyond_max_adapters_the_oldest_unused_versions_are_dropped() -> None:
    base = _model("llama")
    versions = Versions(base, ["q_proj"])
    b = Batcher(
        base,
        eos_token_ids=[EOS],
        decode=lambda ids: "".join(chr(65 + i % 26) for i in ids),
        config=BatcherConfig(max_running=8, max_adapters=2),
    )
    params = SamplingParams(max_tokens=20, seed=0, ignore_eos=True)
    b.load_adapter(1, versions.published[1], keep=False)
    busy = b.new_sequence("busy", [3, 4, 5], params, version=1)
    b.add(busy)
    b.step()
    b.load_adapter(2, versions.published[2], keep=False)
    b.load_adapter(3, versions.published[3], keep=False)
    assert b.held_versions() == [0, 1, 3]  # 2 dropped; 1 is still decoding
    while b.has_work():
        b.step()
    assert busy.versions == [1] * 20
    b.load_adapter(4, versions.published[1], keep=False)
    assert b.held_versions() == [0, 3, 4]
