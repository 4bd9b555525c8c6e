"""A slotted KV cache that Hugging Face attention layers write into: one row per running sequence.

Layout: per layer, K and V are preallocated tensors `[rows, kv_heads, cols, head_dim]`. Row `i`
holds the keys and values of sequence i's first `lens[i]` tokens in columns `[0, lens[i])`; the rest
is garbage that the attention mask hides. Rows `[0, n)` are the running sequences, kept dense by
moving the last row into a freed one, so a decode step computes on exactly the live rows and never
copies the cache: each layer writes its one new key per row at column `lens[i]` (an indexed store)
and attends over a view of the first `max(lens) + 1` columns. Buffers grow by doubling, so the
amortised cost of growth is small.

The object duck-types the one method HF attention calls, `update(key, value, layer_idx, ...)`. The
model is always called with a ready 4D mask and explicit position ids, so HF never asks the cache
for lengths (`create_causal_mask` returns a 4D mask as is). Prefill runs in a separate mode: the new
rows' keys pass through untouched and `commit_prefill` copies them into their rows afterwards.
"""

from __future__ import annotations

import torch


class SlotCache:
    """Per-layer K/V slots; shapes are taken from the first prefill (any head count, GQA or not)."""

    def __init__(
        self, num_layers: int, *, max_rows: int, max_cols: int, device: torch.device | None = None
    ) -> None:
        self.num_layers = num_layers
        self.device = torch.device("cpu") if device is None else device
        self.max_rows, self.max_cols = max_rows, max_cols
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows_cap = 0
        self.cols_cap = 0
        self._prefill = True
        self._fresh_k: list[torch.Tensor] = []
        self._fresh_v: list[torch.Tensor] = []
        self._rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._cols = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._n = 0
        self._kv_len = 0
        # dtype and head shape of the buffers, once known
        self._like = torch.zeros(0, 1, 0, 1, device=self.device)

    # -- called by the model -----------------------------------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefill:
            self._fresh_k.append(key_states)
            self._fresh_v.append(value_states)
            return key_states, value_states
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[self._rows, :, self._cols] = key_states[:, :, 0]
        v[self._rows, :, self._cols] = value_states[:, :, 0]
        return k[: self._n, :, : self._kv_len], v[: self._n, :, : self._kv_len]

    # -- called by the batcher ---------------------------------------------------------------------

    def begin_prefill(self) -> None:
        self._prefill = True
        self._fresh_k, self._fresh_v = [], []

    def begin_decode(self, n: int, lens: torch.Tensor, kv_len: int) -> None:
        """The next forward writes one token per row of `[0, n)` at column `lens[i]`."""
        self._prefill = False
        self._n = n
        if self._rows.numel() != n:
            self._rows = torch.arange(n, device=self.device)
        self._cols = lens
        self._kv_len = kv_len

    def commit_prefill(
        self, start: int, lengths: list[int], *, sources: torch.Tensor | None = None
    ) -> None:
        """Copy the last prefill's keys into rows `start, start + 1, ...`: prefill row
        `sources[j]` into row `start + j` (by default prefill row j)."""
        b, width = len(lengths), self._fresh_k[0].shape[2]
        self._like = self._fresh_k[0][:0, :, :0]
        self.ensure(start + b, width + 1)
        for layer in range(self.num_layers):
            k, v = self._fresh_k[layer], self._fresh_v[layer]
            if sources is not None:
                k, v = k[sources], v[sources]
            self.k[layer][start : start + b, :, :width] = k
            self.v[layer][start : start + b, :, :width] = v
        self._fresh_k, self._fresh_v = [], []

    def ensure(self, rows: int, cols: int) -> None:
        """Grow the buffers (by doubling) so that they hold at least `rows` x `cols`."""
        if rows <= self.rows_cap and cols <= self.cols_cap:
            return
        template = self.k[0] if self.k else self._like
        new_rows = max(self.rows_cap, 1)
        while new_rows < rows:
            new_rows *= 2
        new_rows = max(min(new_rows, self.max_rows), rows)
        new_cols = max(self.cols_cap, 64)
        while new_cols < cols:
            new_cols *= 2
        new_cols = max(min(new_cols, self.max_cols), cols)
        _, heads, _, dim = template.shape
        shape = (new_rows, heads, new_cols, dim)
        for layer in range(self.num_layers):
            for store in (self.k, self.v):
                fresh = template.new_zeros(shape)
                if layer < len(store):
                    old = store[layer]
                    fresh[: old.shape[0], :, : old.shape[2]] = old
                    store[layer] = fresh
                else:
                    store.append(fresh)
        self.rows_cap, self.cols_cap = new_rows, new_cols

    def move_row(self, src: int, dst: int, length: int) -> None:
        for layer in range(self.num_layers):
            self.k[layer][dst, :, :length] = self.k[layer][src, :, :length]
            self.v[layer][dst, :, :length] = self.v[layer][src, :, :length]

    def export_row(self, row: int, length: int) -> torch.Tensor:
        """The row's first `length` tokens as a tensor `[layers, 2, kv_heads, length, head_dim]`."""
        return torch.stack(
            [
                torch.stack([self.k[i][row, :, :length], self.v[i][row, :, :length]])
                for i in range(self.num_layers)
            ]
        )

    def import_row(self, row: int, kv: torch.Tensor) -> None:
        """Write an exported `[layers, 2, kv_heads, length, head_dim]` tensor (wherever it is:
        an import arrives in host memory) into `row`."""
        kv = kv.to(self.device)
        length = kv.shape[3]
        self._like = kv[0, 0, :, :0][None]
        self.ensure(row + 1, length + 1)
        for layer in range(self.num_layers):
            self.k[layer][row, :, :length] = kv[layer, 0]
            self.v[layer][row, :, :length] = kv[layer, 1]

    def reset(self) -> None:
        """Drop every buffer (memory goes back to the allocator)."""
        self.k, self.v = [], []
        self.rows_cap = self.cols_cap = 0

    @property
    def bytes_per_token(self) -> int:
        if not self.k:
            return 0
        _, heads, _, dim = self.k[0].shape
        return 2 * self.num_layers * heads * dim * self.k[0].element_size()

    @property
    def dtype(self) -> torch.dtype | None:
        return self.k[0].dtype if self.k else None

    @property
    def capacity_tokens(self) -> int:
        return self.rows_cap * self.cols_cap
