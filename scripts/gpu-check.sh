#!/usr/bin/env bash
# The CUDA checks, on a machine with a GPU where meshplan imports (CI has no GPU; see
# docs/cost_model.md, "On a GPU"): bench.gpu_step (the GPU profile's compute constants and a
# one-device training step against the cost model), then tests/test_cuda.py and the
# CUDA-parametrised tests/test_rng.py.  Everything it prints is kept under DIR.
#
#     scripts/gpu-check.sh [DIR]        # default: gpu-check
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/gpu.txt"
timeout 420 python3 -m bench.gpu_step --out "$out" 2>&1 | tee "$out/gpu_step.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cuda.py tests/test_rng.py 2>&1 | tee "$out/pytest.txt"
