#!/usr/bin/env bash
# Every GPU check of the runtime (lossless decode vs plain generate, triton vs the torch reference, a TPOT table),
# in one run, well under 5 minutes on one GPU. From the repository root, on a machine with a CUDA GPU:
#   bash scripts/gpu_check.sh            # JSON to stdout and to $OUT/gpu_check.json (OUT defaults to runs/gpu-check)
# It installs this package from the working tree (`pip install --no-deps -e .`, the mapping in pyproject.toml) into
# the Python given as PY when it does not import yet; that Python must already have the dependencies, with
# transformers >= 5 (the fused-experts model classes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! $PY -c "import expertcache.runtime" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . || $PY -m pip install -q --no-deps -e .
fi
$PY - <<'PY'
import sys, transformers
major = int(transformers.__version__.split(".")[0])
if major < 5:
    sys.exit(f"gpu_check: transformers {transformers.__version__} here; expertcache needs >= 5 (carry a wheel)")
PY
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec $PY scripts/gpu_check.py
