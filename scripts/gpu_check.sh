#!/usr/bin/env bash
# GPU check: export timm ViT-B/16 (random init) at budgets 0.1..0.6, build fp16 TensorRT engines,
# measure throughput (batch 128), latency (batch 1) and budget switch cost against dense, next to
# the paper's A100 figures; also onnxruntime's CUDA EP when onnxruntime-gpu is installed.
# Writes benchmarks/results/gpu_check.{json,md}. Exit 1 (with what is missing) without a GPU.
# With a GPU but no TensorRT (or GPU_CHECK_BACKEND=torch), it measures the same budgets as sliced
# PyTorch modules instead: benchmarks/gpu_torch.py (its own arguments), gpu_torch.{json,md}.
# Python: $PYTHON, else ./.venv/bin/python, else python3 (the first with elastic_export installed). Extra arguments go to benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# the first of $PYTHON, ./.venv, python3 that has elastic_export installed (else the first that exists)
PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 || continue
  [[ -z "$PY" ]] && PY="$cand"
  if "$cand" -c "import elastic_export.targets.tensorrt" >/dev/null 2>&1; then PY="$cand"; break; fi
done
[[ -n "$PY" ]] || { echo "missing: a python interpreter (set PYTHON=...)" >&2; exit 1; }
echo "gpu_check: using $PY" >&2

missing=()      # needed by both paths
trt_missing=()  # needed by the TensorRT path only
"$PY" -c "import elastic_export.targets.tensorrt" >/dev/null 2>&1 \
  || missing+=("elastic-export for $PY (pip install -e \".[tensorrt]\" cuda-python)")
for mod in torch timm onnx onnxruntime; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("python module $mod")
done
"$PY" -c "import tensorrt" >/dev/null 2>&1 || trt_missing+=("python module tensorrt (pip install -e \".[tensorrt]\")")
"$PY" -c "import cuda.bindings.runtime" >/dev/null 2>&1 || "$PY" -c "from cuda import cudart" >/dev/null 2>&1 \
  || "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1 \
  || trt_missing+=("cuda-python (pip install cuda-python) or torch with CUDA")
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  missing+=("an NVIDIA GPU (nvidia-smi finds none)")
fi
if (( ${#missing[@]} )); then
  for m in "${missing[@]}" "${trt_missing[@]}"; do echo "missing: $m" >&2; done
  echo "gpu_check: cannot run here (install with: pip install -e \".[tensorrt]\" cuda-python on a CUDA machine)" >&2
  exit 1
fi
nvidia-smi -L >&2
if (( ${#trt_missing[@]} )) || [[ "${GPU_CHECK_BACKEND:-tensorrt}" == torch ]]; then
  # no TensorRT: the same budgets as physically sliced PyTorch modules on the GPU (a lower bound on
  # an engine's gains); arguments go to benchmarks/gpu_torch.py
  for m in "${trt_missing[@]}"; do echo "missing for TensorRT: $m" >&2; done
  "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1 \
    || { echo "gpu_check: torch sees no CUDA GPU either; cannot run here" >&2; exit 1; }
  echo "gpu_check: measuring the sliced budgets in PyTorch instead (benchmarks/gpu_torch.py)" >&2
  exec timeout "${GPU_CHECK_TIMEOUT:-470}" "$PY" benchmarks/gpu_torch.py "$@"
fi
exec timeout "${GPU_CHECK_TIMEOUT:-470}" "$PY" benchmarks/gpu_check.py "$@"
