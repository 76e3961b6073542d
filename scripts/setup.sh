#!/usr/bin/env bash
# Install spectrain (editable) with its dev extras. torch is pinned to a build that exists on a CPU
# machine's disk when torch is absent; an existing torch in the supported range is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
