"""Emulated accelerators: the real `dora serve` and `dora learn` on modelled time.

See docs/emulation.md.

- `model.py`: what an instance samples (the simulator's lengths, deterministic per sample);
- `instance.py`: one instance's continuous batching on a scaled clock (the simulator's costs);
- `server.py`: its HTTP API (the embedded engine's routes);
- `cluster.py`: many instances in one process, and how `dora serve` starts them;
- `trainer.py`: `dora learn` spending modelled training time instead of compute.
"""
