#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU, PyTorch installed and no network, checks the
# embedded engine on the GPU (its logprobs against a forward pass, before and after a weight load;
# model.generate's throughput), one trainer step on the GPU against the same step on the CPU,
# trainer rank 0's weight broadcast against what serve tells the instances (a gloo stand-in for
# NCCL), and a short `dora run` of the math example with the engine and the trainer sharing the
# GPU in bfloat16; prints its figures. Within 8 minutes.
#   scripts/gpu-check.sh          # on the GPU
#   scripts/gpu-check.sh --cpu    # the CPU fallback: every part on the CPU
# PYTHON picks the interpreter (default: python3); dora's checkout is put first on PYTHONPATH.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"   # the check needs no network: say so to the hub
exec timeout 480 "${PYTHON:-python3}" "$here/scripts/gpu_check.py" "$@"
