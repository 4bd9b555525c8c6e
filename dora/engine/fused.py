"""A fused decode step for Llama-style models: one token per running row, in a few tensor calls.

At the sizes an engine instance runs on a CPU, a decode step costs mostly Python: Hugging Face's
modules, mask helpers and cache plumbing make dozens of calls per layer. `FusedDecoder` runs the
same arithmetic straight on the model's weights: per layer one RMSNorm, one matmul for q, k and v
together, the rotary embedding from a table precomputed for every position, one indexed store of
the new keys and values into the engine's slotted cache (kvcache.py), one SDPA call over the live
rows and columns, the output projection, and one matmul for gate and up together.

Invariants:
- Numerics are the model's own: the same RMSNorm formula (torch's fused `rms_norm`, which gives
  Hugging Face's LlamaRMSNorm bit for bit in float32), the same rotary cos/sin values (the
  model's rotary embedding evaluated once at every position), the same SDPA scale, the same MLP;
  only the grouping of matmuls differs (concatenated weights), and the rotary's multiply and add
  are one `addcmul`, which changes logits by float rounding only. The engine's logprob parity
  tests hold against the trainer's forward pass.
- The concatenated weights are copies, so they are rebuilt whenever the model's weights change:
  every step compares the parameters' in-place version counters with those they were built from
  (weight loads copy into the parameters in place, which bumps them), so a new version can never
  decode with the old one's weights.
- LoRA versions (lora.py): with an `AdapterSet` and each row's slot, every fused matmul adds the
  rows' low-rank deltas (the group's adapters concatenated as its weights are), two batched
  matmuls per group, so rows of different versions decode in the same step.
- Only architectures whose layers are exactly this (`supported()`) take the path: Llama and Qwen2
  with SiLU MLPs, no sliding window, and a rotary embedding whose frequencies do not depend on the
  sequence (no dynamic scaling). Everything else decodes through Hugging Face's modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dora.engine.lora import AdapterSet, delta

_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
"""The linear layers of a decoder layer whose weights each fused matmul concatenates."""


def supported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot take the fused path (None if it can)."""
    hf: Any = model
    config = hf.config
    if config.model_type not in ("llama", "qwen2"):
        return f"model_type {config.model_type!r} (fused: llama, qwen2)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope = getattr(hf.base_model.rotary_emb, "rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} (its frequencies depend on the sequence)"
    return None


class FusedDecoder:
    """Decode logits for rows `[0, n)` of a slotted cache, from a Llama-style HF model."""

    def __init__(
        self, model: torch.nn.Module, max_positions: int, adapters: AdapterSet | None = None
    ) -> None:
        hf: Any = model
        self.adapters = adapters
        self.model = model
        self.base: Any = hf.base_model
        self.lm_head: Any = hf.get_output_embeddings()
        config = hf.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.max_positions = max_positions
        self._params = list(model.parameters())
        self._weights: list[tuple[Any, ...]] = []
        self._stamp: tuple[int, ...] = ()
        self.device = next(model.parameters()).device
        self._rope = torch.zeros(0, device=self.device)
        self._arange = torch.arange(max_positions, device=self.device)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the concatenated weights and the rotary tables from the model as it is now."""
        with torch.inference_mode():
            prefix = {id(module): name for name, module in self.model.named_modules()}
            layers = []
            for layer in self.base.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
                biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
                qkv_b = torch.cat(biases) if all(b is not None for b in biases) else None
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                names = tuple(
                    tuple(f"{prefix[id(layer)]}.{part}" for part in group) for group in _GROUPS
                )
                layers.append(
                    (
                        names,
                        layer.input_layernorm.weight,
                        qkv_w,
                        qkv_b,
                        att.o_proj.weight,
                        layer.post_attention_layernorm.weight,
                        gate_up,
                        mlp.down_proj.weight,
                    )
                )
            self._weights = layers
            probe = self.base.embed_tokens.weight[:1, None]
            positions = torch.arange(self.max_positions, device=self.device)[None]
            cos, sin = self.base.rotary_emb(probe, positions)
            # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated): one
            # roll per layer instead of two slices, a negation and a concatenation
            half = self.head_dim // 2
            signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)
            self._rope = torch.stack((cos[0], signed), 1)[:, :, None]  # [positions, 2, 1, dim]
        self._stamp = self._versions()

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        kv_len: int,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[n, vocab]` for one new token per row: `ids[i]` at `positions[i]`, written into
        column `positions[i]` of row i of every layer's cache; attends over columns `[0, kv_len)`
        (columns past a row's position are masked). `slots[i]`: row i's adapter slot (lora.py);
        None or all zeros: the base weights only."""
        if self._versions() != self._stamp:
            self.refresh()
        adapters = self.adapters
        if adapters is None or not adapters.slot_of or slots is None or not bool(slots.any()):
            adapters = None

        def linear(
            h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: tuple[str, ...]
        ) -> torch.Tensor:
            out = F.linear(h, w, b)
            if adapters is None:
                return out
            stacks = adapters.group_stacks(group)
            if stacks is None:
                return out
            assert slots is not None
            return out + delta(h, stacks[0], stacks[1], slots)

        n = ids.shape[0]
        if n > self._arange.numel():  # more rows than positions (a short max_model_len)
            self._arange = torch.arange(n, device=self.device)
        rows = self._arange[:n]
        mask = (self._arange[:kv_len] <= positions[:, None])[:, None, None, :]
        rope = self._rope[positions]
        cos, sin = rope[:, 0], rope[:, 1]  # [n, 1, head_dim]
        half = self.head_dim // 2
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        gqa = self.heads != self.kv_heads
        x = self.base.embed_tokens.weight[ids]  # [n, hidden]
        hidden = x.shape[-1]
        for i, layer in enumerate(self._weights):
            names, w_in, qkv_w, qkv_b, o_w, w_post, gate_up, down = layer
            h = F.rms_norm(x, (hidden,), w_in, self.eps)
            qkv = linear(h, qkv_w, qkv_b, names[0])
            # q and k heads side by side, so that one rotary expression turns both
            qk = qkv[:, : q_size + kv_size].view(n, self.heads + self.kv_heads, self.head_dim)
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, q_size + kv_size :].view(n, self.kv_heads, self.head_dim)
            k_all, v_all = k_cache[i], v_cache[i]
            k_all[rows, :, positions] = k
            v_all[rows, :, positions] = v
            att = F.scaled_dot_product_attention(
                q[:, :, None],
                k_all[:n, :, :kv_len],
                v_all[:n, :, :kv_len],
                attn_mask=mask,
                enable_gqa=gqa,
            )
            x = x + linear(att.reshape(n, q_size), o_w, None, names[1])
            h = F.rms_norm(x, (hidden,), w_post, self.eps)
            gate, up = linear(h, gate_up, None, names[2]).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, down, None, names[3])
        x = F.rms_norm(x, (hidden,), self.base.norm.weight, self.base.norm.variance_epsilon)
        logits: torch.Tensor = self.lm_head(x)
        return logits
