#!/usr/bin/env bash
# Install spectrain (editable) with its dev extras into the current Python environment.
# torch: an existing torch (CUDA builds, vLLM / SGLang environments) is never replaced; pyproject.toml
# states a lower bound only. Only where torch is absent is the CPU build the development machines
# have on disk (2.13.0) installed first, so set-up never pulls a multi-GB CUDA build there.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
