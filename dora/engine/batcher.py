"""Continuous batching over a Hugging Face causal LM, in plain synchronous torch.

`Batcher.step()` is one scheduling iteration: admit waiting sequences (FIFO, within the caps on
running sequences, reserved KV tokens and prefill tokens per step), prefill them together, sample
their first token, then run one decode step over every running sequence. A sequence leaves the batch
the step it finishes. Nothing here is thread-safe: `EngineWorker` (worker.py) owns a Batcher on one
thread.

Speed at tiny-model scale is Python overhead, so a decode step is a fixed number of tensor
operations whatever the batch holds: per-row state lives in a few tensors indexed by row (rows
`[0, n)` are live, kept dense by moving the last row into a freed one), the KV cache is slotted
(kvcache.py), sampling is one vectorised call (sampling.py), and finish checks are tensor
expressions. The only per-row Python is appending the sampled ids to each sequence's lists, and
stop-string checks for rows that have them. For Llama-style models the decode step skips HF's
modules (fused.py: a few tensor calls per layer on the model's own weights); prefill runs each
distinct prompt of a step once and copies its KV into the rows of every sequence that has it, so
a group's G samples share one prefill.

LoRA versions (lora.py): the batcher holds the base weights as one version (`base_version`) and
any number of adapter versions; each row decodes under its own version (a pinned request's, else
the newest at admission), through a per-row low-rank delta on the shared base matmuls, so one
step serves rows of every version it holds.

KV memory is bounded by reservation. The cache is dense (rows x columns), so what a batch can come
to hold is `rows x the longest prompt + max_tokens among them`; a sequence is admitted only if that
stays within `max_kv_tokens` (by default `max_kv_bytes` worth), so nothing ever needs preemption.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dora.engine.fused import FusedDecoder, supported
from dora.engine.kvcache import SlotCache
from dora.engine.lora import AdapterSet
from dora.engine.sampling import SamplingBatch, sample, sequence_key
from dora.engine.sequence import Sequence
from dora.protocol import Completion, FinishReason, SamplingParams

# columns of Batcher._ints (_LEN and _GEN side by side: a decode step advances both in one op)
_LEN, _GEN, _LAST, _MAX, _MIN, _TOPK, _KEY, _VER, _SLOT = range(9)
_INTS = 9
# columns of Batcher._floats
_TEMP, _TOPP = range(2)


@dataclass(kw_only=True)
class BatcherConfig:
    """Caps of one engine instance."""

    max_running: int = 256
    """Most sequences decoded together."""
    max_kv_tokens: int | None = None
    """Most KV tokens the dense cache may come to hold (default: `max_kv_bytes` worth)."""
    max_kv_bytes: int = 4 << 30
    """KV memory budget used when `max_kv_tokens` is not given."""
    max_prefill_tokens: int = 8192
    """Most prompt tokens (padded, each distinct prompt once) prefilled in one step; one longer
    prompt still goes alone."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); defaults to the model's max_position_embeddings."""
    fused_decode: bool = True
    """Decode Llama-style models with the fused step (fused.py) where the model supports it."""
    max_adapters: int = 8
    """Most LoRA adapter versions held: a load beyond it drops the oldest ones no request uses."""


class Batcher:
    """Continuous batching state and the step that advances it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        decode: Callable[[list[int]], str],
        version: int = 0,
        config: BatcherConfig | None = None,
    ) -> None:
        self.model = model
        self.config = config or BatcherConfig()
        hf: Any = model  # a PreTrainedModel; torch's stubs do not know its attributes
        hf_config = hf.config
        self.max_model_len = self.config.max_model_len or int(hf_config.max_position_embeddings)
        self.vocab_size = int(hf.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = list(eos_token_ids)
        self.decode = decode
        self.version = version
        """The version unpinned requests get: the newest loaded."""
        self.base_version = version
        """The version of the model's own weights (adapter slot 0)."""
        self.adapters = AdapterSet(model)
        self.admission_paused = False
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved_tokens = 0
        """Dense KV tokens the running sequences may come to hold: rows x longest reservation."""
        self._longest = 0
        self.generated_tokens = 0
        self.device = next(model.parameters()).device
        """Where the model's weights are, and so every tensor of the batch."""
        self._base: Any = hf.base_model
        self._lm_head: Any = hf.get_output_embeddings()
        self._cache = SlotCache(
            int(hf_config.num_hidden_layers),
            max_rows=self.config.max_running,
            max_cols=self.max_model_len + 1,
            device=self.device,
        )
        heads = int(getattr(hf_config, "num_attention_heads", 1))
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        itemsize = next(model.parameters()).element_size()
        self.kv_layout = (int(hf_config.num_hidden_layers), 2, kv_heads, head_dim)
        self.kv_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.kv_bytes_per_token = (
            2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * itemsize
        )
        self.max_kv_tokens = self.config.max_kv_tokens or max(
            self.config.max_kv_bytes // self.kv_bytes_per_token, 1
        )
        forward_params = _signature_params(self._base.forward)
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self._float_mask = getattr(hf_config, "_attn_implementation", "sdpa") == "eager"
        self._rng = random.Random()
        self._ints = torch.zeros(0, _INTS, dtype=torch.int64, device=self.device)
        self._floats = torch.zeros(0, 2, dtype=torch.float32, device=self.device)
        self._stop_mask = torch.zeros(0, self.vocab_size, dtype=torch.bool, device=self.device)
        self._stop_rows = 0  # running sequences with stop strings
        self._min_rows = 0  # running sequences with min_tokens
        self._greedy_rows = 0  # running sequences sampled at temperature 0
        self._truncated_rows = 0  # running sequences with top-k or top-p
        self._fused = (
            FusedDecoder(model, self.max_model_len + 1, self.adapters)
            if self.config.fused_decode and supported(model) is None and not self._float_mask
            else None
        )

    # -- requests ----------------------------------------------------------------------------------

    def new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        **kwargs: object,
    ) -> Sequence:
        """A Sequence whose noise key comes from `params.seed` (or a random seed) and `index`."""
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        return Sequence(
            id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            key=sequence_key(seed, index),
            **kwargs,  # type: ignore[arg-type]
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_all(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and not self.admission_paused)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.id == request_id:
                return seq
        for seq in self.waiting:
            if seq.id == request_id:
                return seq
        return None

    def abort(self, seq: Sequence) -> Completion:
        """Stop a waiting or running sequence; its listener hears finish_reason "abort"."""
        if seq.row >= 0:
            self._remove(seq.row)
        else:
            self.waiting.remove(seq)
        seq.finish_reason = "abort"
        self._notify(seq)
        return seq.completion()

    def abort_all(self) -> list[Completion]:
        return [self.abort(seq) for seq in [*reversed(self.running), *self.waiting]]

    def detach(self, seq: Sequence) -> torch.Tensor | None:
        """Remove a sequence for export; return its KV `[layers, 2, heads, len, dim]` if running,
        copied to host memory (it leaves the engine)."""
        kv = None
        if seq.row >= 0:
            kv = self._cache.export_row(seq.row, int(self._ints[seq.row, _LEN]))
            kv = kv.to("cpu", copy=True)
            self._remove(seq.row)
        else:
            self.waiting.remove(seq)
        seq.finish_reason = "abort"
        self._notify(seq)
        return kv

    # -- the step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit and prefill what fits, then decode one token for every running sequence."""
        if not self.admission_paused:
            self._admit()
        if self.running:
            self._decode()

    def _admit(self) -> None:
        new: list[Sequence] = []
        imported: list[Sequence] = []
        width = 0
        prompts: set[tuple[int, ...]] = set()  # distinct prompts: each is prefilled once
        while (
            self.waiting and len(self.running) + len(new) + len(imported) < self.config.max_running
        ):
            seq = self.waiting[0]
            if seq.version is not None and seq.version not in self.held_versions():
                self.waiting.popleft()
                held = ", ".join(map(str, self.held_versions()))
                self._fail(
                    seq, f"request pinned to version {seq.version}, engine holds {held}", 409
                )
                continue
            total = len(seq.prompt_ids) + len(seq.token_ids)
            if total >= self.max_model_len or not seq.prompt_ids:
                self.waiting.popleft()
                self._fail(
                    seq,
                    f"prompt of {total} tokens does not fit max_model_len {self.max_model_len}",
                    400,
                )
                continue
            need = self._reservation(seq)
            rows = len(self.running) + len(new) + len(imported) + 1
            if rows * max(self._longest, need) > self.max_kv_tokens and (
                self.running or new or imported
            ):
                break
            if seq.kv_import is None:
                wider = max(width, len(seq.prompt_ids))
                key = (self._slot(seq), *seq.prompt_ids)
                distinct = len(prompts) + (key not in prompts)
                if new and wider * distinct > self.config.max_prefill_tokens:
                    break
                width = wider
                prompts.add(key)
                new.append(seq)
            else:
                imported.append(seq)
            self.waiting.popleft()
            self._longest = max(self._longest, need)
            self.reserved_tokens = rows * self._longest
        if imported:
            self._admit_imported(imported)
        if new:
            self._prefill(new)

    def _prefill(self, new: list[Sequence]) -> None:
        """Prefill each distinct prompt once (a group's G samples share theirs), then copy its
        keys and values into the row of every sequence that has it. Prompts of different
        versions are distinct."""
        b, start = len(new), len(self.running)
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault((self._slot(s), *s.prompt_ids), len(first)) for s in new]
        prompts = [new[source.index(u)].prompt_ids for u in range(len(first))]
        dev = self.device
        firsts = [new[source.index(u)] for u in range(len(first))]
        slots = torch.tensor([self._slot(s) for s in firsts], device=dev)
        u = len(prompts)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        padded = [[*prompt, *[0] * (width - len(prompt))] for prompt in prompts]
        ids = torch.tensor(padded, dtype=torch.int64, device=dev)  # one copy to the device
        plen = torch.tensor(lengths, device=dev)
        cols = torch.arange(width, device=dev)
        mask = (cols[None, :, None] >= cols[None, None, :]) & (
            cols[None, None, :] < plen[:, None, None]
        )
        self._cache.begin_prefill()
        with self.adapters.rows(slots):
            hidden = self._forward(ids, mask[:, None], cols.expand(u, width))
        last = hidden[torch.arange(u, device=dev), plen - 1]
        logits = self._lm_head(last)
        rows_of = torch.tensor(source, device=dev)
        self._cache.commit_prefill(start, [lengths[j] for j in source], sources=rows_of)
        self._grow_state(start + b)
        for j, s in enumerate(new):
            self._place(s, start + j, lengths[source[j]])
        self._sample_rows(start, start + b, logits[rows_of])

    def _admit_imported(self, imported: list[Sequence]) -> None:
        for s in imported:
            row = len(self.running)
            assert s.kv_import is not None
            self._cache.import_row(row, s.kv_import)
            self._grow_state(row + 1)
            self._place(s, row, s.kv_import.shape[3])
            self._ints[row, _LAST] = s.token_ids[-1]
            self._ints[row, _GEN] = len(s.token_ids)
            s.kv_import = None

    def _decode(self) -> None:
        n = len(self.running)
        lens = self._ints[:n, _LEN]
        kv_len = int(lens.max()) + 1
        self._cache.ensure(n, kv_len)
        if self._fused is not None:
            logits = self._fused.decode(
                self._ints[:n, _LAST],
                lens,
                self._cache.k,
                self._cache.v,
                kv_len,
                self._ints[:n, _SLOT],
            )
        else:
            cols = torch.arange(kv_len, device=self.device)
            mask = (cols[None, :] <= lens[:, None])[:, None, None, :]
            self._cache.begin_decode(n, lens, kv_len)
            with self.adapters.rows(self._ints[:n, _SLOT]):
                hidden = self._forward(self._ints[:n, _LAST, None], mask, lens[:, None])
            logits = self._lm_head(hidden[:, 0])
        self._sample_rows(0, n, logits, decoded=True)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states through HF's modules (under the adapters of `adapters.row_slots`)."""
        attn: torch.Tensor = mask
        if self._float_mask:
            attn = torch.zeros(mask.shape, device=self.device)
            attn = attn.masked_fill(~mask, torch.finfo(torch.float32).min)
        kwargs = {self._cache_kw: self._cache}
        out = self._base(
            input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **kwargs
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _sample_rows(
        self, start: int, end: int, logits: torch.Tensor, *, decoded: bool = False
    ) -> None:
        """Sample the next token of rows `[start, end)` from their `logits`; `decoded`: the
        logits come from a decode step, whose token each row's cache now holds."""
        ints, floats = self._ints[start:end], self._floats[start:end]
        gen = ints[:, _GEN]
        banned = None
        if self._min_rows:
            under_min = gen < ints[:, _MIN]
            if bool(under_min.any()):
                banned = self._stop_mask[start:end] & under_min[:, None]
        everyone = start == 0 and end == len(self.running)  # the counters describe these rows
        batch = SamplingBatch(
            temperature=floats[:, _TEMP],
            top_p=floats[:, _TOPP],
            top_k=ints[:, _TOPK],
            keys=ints[:, _KEY],
            steps=gen,
            banned=banned,
            any_greedy=self._greedy_rows > 0 if everyone else None,
            any_truncation=self._truncated_rows > 0 if everyone else None,
            max_step=self.max_model_len,
        )
        tokens, logprobs = sample(logits, batch)
        ints[:, _LAST] = tokens
        if decoded:
            ints[:, _LEN : _GEN + 1] += 1
        else:
            ints[:, _GEN] += 1
        stopped = self._stop_mask[start:end].gather(1, tokens[:, None])[:, 0]
        # _MAX is at most max_model_len - prompt, so it also ends a row about to outgrow the
        # model (a row's cache holds its prompt and every token but the last)
        full = ints[:, _GEN] >= ints[:, _MAX]
        done = (stopped | full).nonzero()[:, 0].tolist()
        seqs = self.running[start:end]
        lps = logprobs.tolist()
        versions = ints[:, _VER].tolist()
        for seq, tok, lp, v in zip(seqs, tokens.tolist(), lps, versions, strict=True):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(v)
        self.generated_tokens += end - start
        finished: dict[int, FinishReason] = {}
        for i in done:
            finished[start + i] = "stop" if bool(stopped[i]) else "length"
        # Finite logits give finite logprobs at any allowed temperature; weights that produce
        # NaN or inf must end the request with an error, never reach a client as non-JSON.
        broken = {start + i for i, lp in enumerate(lps) if not math.isfinite(lp)}
        for row in broken:
            finished[row] = "error"
        if self._stop_rows:
            for seq in seqs:
                if seq.params.stop and seq.row not in finished and self._hit_stop_string(seq):
                    finished[seq.row] = "stop"
        for seq in seqs:
            if seq.stream and seq.row not in finished:
                self._notify(seq)
        for row in sorted(finished, reverse=True):
            seq = self.running[row]
            seq.finish_reason = finished[row]
            if row in broken:
                seq.error_status = 500
                seq.error = (
                    f"version {seq.versions[-1]} of the model gave a non-finite logprob "
                    f"({seq.logprobs[-1]}) at token {len(seq.token_ids) - 1}: "
                    "its weights are broken"
                )
            self._remove(row)
            self._notify(seq)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        tail = self.decode(seq.token_ids[-(longest + 8) :])
        return any(s in tail for s in seq.params.stop)

    # -- rows --------------------------------------------------------------------------------------

    def _grow_state(self, rows: int) -> None:
        if rows <= self._ints.shape[0]:
            return
        cap = max(2 * self._ints.shape[0], rows, 16)
        ints = torch.zeros(cap, _INTS, dtype=torch.int64, device=self.device)
        floats = torch.zeros(cap, 2, dtype=torch.float32, device=self.device)
        stop_mask = torch.zeros(cap, self.vocab_size, dtype=torch.bool, device=self.device)
        n = self._ints.shape[0]
        ints[:n], floats[:n], stop_mask[:n] = self._ints, self._floats, self._stop_mask
        self._ints, self._floats, self._stop_mask = ints, floats, stop_mask

    def _place(self, seq: Sequence, row: int, cached: int) -> None:
        p = seq.params
        self._ints[row] = torch.tensor(
            [
                cached,
                0,
                0,
                min(p.max_tokens, self.max_model_len - len(seq.prompt_ids)),
                p.min_tokens,
                p.top_k,
                seq.key,
                self.version_of(seq),
                self._slot(seq),
            ],
            device=self.device,
        )
        self._floats[row] = torch.tensor([p.temperature, p.top_p], device=self.device)
        stop_ids = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
        self._stop_mask[row] = False
        self._stop_mask[row, [t for t in stop_ids if 0 <= t < self.vocab_size]] = True
        seq.row = row
        self.running.append(seq)
        self._count(p, 1)

    @torch.inference_mode()  # also runs between steps (abort, export) on inference tensors
    def _remove(self, row: int) -> None:
        """Free a row: the last running row moves into it (rows stay dense)."""
        seq = self.running[row]
        last = len(self.running) - 1
        if row != last:
            moved = self.running[last]
            self._cache.move_row(last, row, int(self._ints[last, _LEN]))
            self._ints[row] = self._ints[last]
            self._floats[row] = self._floats[last]
            self._stop_mask[row] = self._stop_mask[last]
            self.running[row] = moved
            moved.row = row
        self.running.pop()
        seq.row = -1
        self._longest = max((self._reservation(s) for s in self.running), default=0)
        self.reserved_tokens = len(self.running) * self._longest
        self._count(seq.params, -1)

    def _count(self, p: SamplingParams, sign: int) -> None:
        """Keep the counts of running rows that need the optional parts of sampling."""
        self._stop_rows += sign * bool(p.stop)
        self._min_rows += sign * (p.min_tokens > 0)
        self._greedy_rows += sign * (p.temperature <= 0)
        self._truncated_rows += sign * (p.top_k > 0 or p.top_p < 1)

    # -- versions ----------------------------------------------------------------------------------

    def held_versions(self) -> list[int]:
        """Every version a request may be pinned to: the base weights' and each adapter's."""
        return sorted({self.base_version, *self.adapters.slot_of})

    def version_of(self, seq: Sequence) -> int:
        """The version a sequence decodes under: its pin, else the newest (a running row keeps
        the version it has, see `load_adapter`)."""
        if seq.row >= 0:
            return int(self._ints[seq.row, _VER])
        return self.version if seq.version is None else seq.version

    def _slot(self, seq: Sequence) -> int:
        return self.adapters.slot_of.get(self.version_of(seq), 0)

    @torch.inference_mode()  # the row state is made of inference tensors
    def load_base(self, version: int) -> None:
        """The model's own weights are now `version`: adapters (trained on the old base) are
        dropped, and rows still running (mode keep) go on under the new weights."""
        self.adapters.clear()
        self.base_version = self.version = version
        self._ints[: len(self.running), _VER] = version
        self._ints[: len(self.running), _SLOT] = 0

    @torch.inference_mode()
    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], *, keep: bool) -> None:
        """Hold adapter `tensors` as `version`, the newest. Running rows keep their version,
        unless `keep` (partial rollout, as with full weights: every running row's next tokens are
        `version`'s; a pin is checked at admission only)."""
        if version == self.base_version:
            raise ValueError(f"version {version} is the base weights' version")
        self.adapters.add(version, tensors)
        self.version = version
        used = {self.version_of(s) for s in [*self.running, *self.waiting]}
        spare = [v for v in self.adapters.versions if v != version and v not in used]
        for old in spare[: max(len(self.adapters.slot_of) - self.config.max_adapters, 0)]:
            self.adapters.remove(old)
        if keep:
            slot = self.adapters.slot_of[version]
            self._ints[: len(self.running), _VER] = version
            self._ints[: len(self.running), _SLOT] = slot

    @torch.inference_mode()
    def unload_adapter(self, version: int) -> None:
        """Drop adapter `version`; refused (ValueError) while it is the newest or a sequence
        still needs it."""
        if version not in self.adapters.slot_of:
            raise KeyError(f"version {version} is not an adapter held here")
        if version == self.version:
            raise ValueError(f"version {version} is the newest: unpinned requests get it")
        users = [s.id for s in [*self.running, *self.waiting] if self.version_of(s) == version]
        if users:
            raise ValueError(f"version {version} is still used by {users[:5]}")
        self.adapters.remove(version)

    def kv_layout_problem(self, shape: list[int], dtype: str, tokens: int) -> str | None:
        """Why an exported KV tensor cannot continue here (None if it can)."""
        layers, two, heads, dim = self.kv_layout
        if dtype != self.kv_dtype:
            return f"dtype {dtype}, this engine caches {self.kv_dtype}"
        if shape != [layers, two, heads, tokens, dim]:
            return f"shape {shape}, this model needs {[layers, two, heads, tokens, dim]}"
        return None

    def _reservation(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)

    def _fail(self, seq: Sequence, message: str, status: int) -> None:
        seq.error, seq.error_status, seq.finish_reason = message, status, "error"
        self._notify(seq)

    def _notify(self, seq: Sequence) -> None:
        if seq.listener is not None:
            seq.listener(seq)

    # -- introspection -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        n = len(self.running)
        used = int(self._ints[:n, _LEN].sum()) if n else 0
        per_token = self._cache.bytes_per_token
        return {
            "running": n,
            "waiting": len(self.waiting),
            "kv_used_tokens": used,
            "kv_reserved_tokens": self.reserved_tokens,
            "kv_max_tokens": self.max_kv_tokens,
            "kv_capacity_tokens": self._cache.capacity_tokens,
            "kv_bytes": self._cache.capacity_tokens * per_token,
            "kv_use": self.reserved_tokens / self.max_kv_tokens,
            "generated_tokens_total": self.generated_tokens,
        }

    @property
    def cache(self) -> SlotCache:
        return self._cache


def _signature_params(fn: Callable[..., object]) -> set[str]:
    import inspect

    return set(inspect.signature(fn).parameters)
