"""`model.dtype` reaches the embedded engine: its model loads in that dtype and decodes with
logprobs that match a forward pass of the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dora.config import load_config
from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.server import load_model
from dora.models.tiny import build_tiny_model
from dora.protocol import SamplingParams
from dora.serve.instances import InstanceSpec, engine_args

pytestmark = pytest.mark.timeout(120)


def test_the_engine_decodes_in_bfloat16(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model, tok = load_model(build_tiny_model(tmp_path / "tiny"), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    eos = [tok.eos_token_id]  # type: ignore[attr-defined]
    b = Batcher(model, eos_token_ids=eos, decode=tok.decode, config=BatcherConfig(max_running=4))  # type: ignore[attr-defined]
    seqs = [
        b.new_sequence(f"r{i}", list(range(3, 8 + i)), SamplingParams(max_tokens=12, seed=i))
        for i in range(4)
    ]
    for s in seqs:
        b.add(s)
    while b.has_work():
        b.step()
    for s in seqs:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1 : -1]
        ref = ref.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert (ref - torch.tensor(s.logprobs)).abs().max() < 2e-2  # bf16 rounding


def test_model_dtype_reaches_the_engine_command_line() -> None:
    spec = InstanceSpec.from_config(load_config(None, ["model.dtype=bfloat16"]), "/m")
    args = engine_args(spec)
    assert args[args.index("--dtype") + 1] == "bfloat16"
