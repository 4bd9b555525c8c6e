"""The worker extension dora loads into every vLLM worker (`--worker-extension-cls
dora.vllm.worker_ext.WeightLoaderExt`); `VllmClient.load_weights` calls it through
`POST /collective_rpc`.

It runs inside the vLLM server's processes (the vllm venv), never in dora's: it imports only
torch, safetensors and the standard library, and vLLM mixes the class into its worker, so `self`
is the worker (`self.reload_weights`, `self.model_runner`).

Why `reload_weights` and not `model.load_weights`: vLLM's CPU build repacks Linear weights into
oneDNN buffers and empties the parameters, so a plain `load_weights` fails half-way with some
tensors already changed. `reload_weights(..., is_checkpoint_format=True)` runs the layerwise
reload that re-processes every layer after loading. One gap remains on tied-embedding models: the
CPU build packs `lm_head` separately and the reload skips it (it has no checkpoint tensor), so the
old head would keep sampling; `_refresh_tied_lm_head` re-packs it from the new embedding.
(research/vllm-cpu-serve.md §5 has the measurements.)

The tensors use Hugging Face checkpoint names, as the trainer publishes them; a partial set of
tensors updates only those.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["WeightLoaderExt"]


class WeightLoaderExt:
    """Methods `collective_rpc` can call on each vLLM worker."""

    reload_weights: object  # provided by the vLLM worker this class is mixed into
    model_runner: object

    def dora_load_path(self, path: str) -> dict[str, object]:
        """Load every tensor of a safetensors file, or of every `*.safetensors` in a folder."""
        from safetensors.torch import load_file

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        return self._dora_load(tensors)

    def dora_load_tensors(self, payload: dict[str, list[object]]) -> dict[str, object]:
        """Load raw tensors sent over HTTP: names, dtypes ("float32", ...), shapes, base64 data."""
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape, data in zip(
            payload["names"], payload["dtypes"], payload["shapes"], payload["data"], strict=True
        ):
            raw = bytearray(base64.b64decode(str(data)))
            flat = torch.frombuffer(raw, dtype=getattr(torch, str(dtype)))
            tensors[str(name)] = flat.reshape([int(d) for d in shape])  # type: ignore[attr-defined]
        return self._dora_load(tensors)

    def _dora_load(self, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
        started = time.perf_counter()
        weights: Iterator[tuple[str, torch.Tensor]] = iter(tensors.items())
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[operator]
        refreshed = _refresh_tied_lm_head(self.model_runner.model)  # type: ignore[attr-defined]
        return {
            "tensors": len(tensors),
            "lm_head_refreshed": refreshed,
            "worker_ms": round((time.perf_counter() - started) * 1000, 3),
        }


def _refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if lm_head is None or embed is None:
        return False
    if lm_head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is None:
        return False
    quant_method.process_weights_after_loading(lm_head)  # re-pack the head from the embedding
    return True
