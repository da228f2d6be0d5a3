#!/usr/bin/env bash
# The GPU check (issue 5): run on a machine with one CUDA GPU, from the repository root, in
# under 8 minutes. Writes gpu_check/gpu_check.{json,md} (or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import lantern_rt" 2>/dev/null; then
  "$PY" -m pip install -q -e . >/dev/null
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PY" -m lantern_rt.eval.gpu_check --out "${1:-gpu_check}"
if "$PY" -c "import tensorrt" 2>/dev/null; then
  bundle=$("$PY" -c "from lantern_rt.generate import cached_bundle, MethodConfig; from lantern_rt.models.model_dir import open_model_dir, DEMO_DIR; print(cached_bundle(open_model_dir(DEMO_DIR), MethodConfig('lantern++', tree='naive_extend_57')))")
  lantern build-engines "$bundle"
  lantern generate --bundle "$bundle" --backend tensorrt --tree naive_extend_57 -n 4 -o "${1:-gpu_check}/tensorrt.png" \
    --stats-json "${1:-gpu_check}/tensorrt.json"
  lantern generate --bundle "$bundle" --backend tensorrt --method ar -n 4 -o "${1:-gpu_check}/tensorrt-ar.png" \
    --stats-json "${1:-gpu_check}/tensorrt-ar.json"
else
  echo "TensorRT is not installed: engines not built"
fi
