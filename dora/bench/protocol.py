"""`dora bench protocol`: how long a group takes to cross the wire (msgspec encode + decode).

A group of 16 samples x 4096 tokens is encoded as the trainer link sends it and decoded back into
numpy views; the time per sample must stay far below a millisecond so that the stream of groups
never matters next to generation and training.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from dora.bench import summary
from dora.protocol import Assigned, Group, Sample, decode_from_serve, encode


def make_group(*, samples: int, tokens: int, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    prompt_len = min(64, tokens // 2)
    return Group(
        id="g0",
        prompt_id="p0",
        version=3,
        samples=[
            Sample.build(
                token_ids=rng.integers(0, 50_000, tokens),
                loss_mask=np.r_[np.zeros(prompt_len), np.ones(tokens - prompt_len)],
                logprobs=-rng.random(tokens),
                versions=np.full(tokens, 3),
                prompt_len=prompt_len,
                reward=float(i % 2),
                reward_components={"correct": float(i % 2)},
            )
            for i in range(samples)
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dora bench protocol", description=summary(__doc__))
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    message = Assigned(step=7, group=make_group(samples=args.samples, tokens=args.tokens))
    frame = encode(message)
    start = time.perf_counter()
    for _ in range(args.repeats):
        decoded = decode_from_serve(encode(message))
        assert isinstance(decoded, Assigned)
        total = sum(int(s.tokens()[-1]) + int(s.mask().sum()) for s in decoded.group.samples)
    elapsed = time.perf_counter() - start
    assert total >= 0
    per_group_ms = elapsed / args.repeats * 1e3
    per_sample_us = per_group_ms * 1e3 / args.samples
    print(
        f"group: {args.samples} samples x {args.tokens} tokens, frame {len(frame) / 2**20:.2f} MiB"
    )
    print(f"round trip (encode + decode + numpy views): {per_group_ms:.3f} ms per group")
    print(f"per sample: {per_sample_us:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
