#!/usr/bin/env bash
# The GPU check: run on a machine with one CUDA GPU, from the repository root, in under 8
# minutes. Writes gpu_check/gpu_check.{json,md} (or $1). Installs nothing: the GPU machine has
# no network, so the checkout runs from PYTHONPATH with the Python packages already there
# (torch with CUDA and Triton, onnx, onnxruntime, safetensors, click, tqdm, pillow, numpy).
# It measures the demo widened to GPT-XL (and GPT-L while the time allows: --sizes-budget),
# built into $LANTERN_CACHE/models (default ~/.cache/lantern-rt/models: 3.1 GB for GPT-XL) in
# another process while the demo runs (lantern_rt/eval/gpu_check.py says what runs in which order),
# and tunes them (`lantern tune --backend torch`, CUDA graphs; a second size past --tune-budget).
# `scripts/gpu_check.sh --quick [OUT]` is the dry run: tiny sizes on whatever device is here
# (a CPU: eager and compiled steps, the demo widened to the `tiny` size and tuned, LlamaGen's loop
# on the demo and on it), no TensorRT.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--quick" ]; then
  "$PY" -m lantern_rt.eval.gpu_check --quick --out "${2:-gpu_check_quick}"
  exit
fi
OUT=${1:-gpu_check}
lantern() { "$PY" -m lantern_rt.cli "$@"; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PY" -c "from torch.utils._triton import has_triton; print('Triton:', 'yes' if has_triton() else 'NO: the compiled modes will fail')"
"$PY" -m lantern_rt.eval.gpu_check --out "$OUT"
if "$PY" -c "import tensorrt" 2>/dev/null; then
  bundle=$("$PY" -c "from lantern_rt.export_cache import cached_bundle; from lantern_rt.settings import MethodConfig; from lantern_rt.families.loading import open_model_dir; print(cached_bundle(open_model_dir(None), MethodConfig('lantern++', tree='naive_extend_57')))")
  lantern build-engines "$bundle"
  lantern generate --bundle "$bundle" --backend tensorrt --tree naive_extend_57 -n 4 -o "$OUT/tensorrt.png" \
    --stats-json "$OUT/tensorrt.json"
  lantern generate --bundle "$bundle" --backend tensorrt --method ar -n 4 -o "$OUT/tensorrt-ar.png" \
    --stats-json "$OUT/tensorrt-ar.json"
else
  echo "TensorRT is not installed: engines not built"
fi
