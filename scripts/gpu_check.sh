#!/usr/bin/env bash
# Every GPU check of the runtime (lossless decode vs plain generate, triton vs the torch reference, a TPOT table),
# in one run, well under 5 minutes on one GPU. From the repository root, on a machine with a CUDA GPU:
#   bash scripts/gpu_check.sh            # JSON to stdout and to $OUT/gpu_check.json (OUT defaults to runs/gpu-check)
# It needs this package importable with transformers >= 5 (the fused-experts model classes): installed with
# `pip install -e .`, or from the source tree as below when the machine's Python already has the dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! $PY -c "import expertcache.runtime" 2>/dev/null; then  # the source tree, mapped as setup would map it
  site=$(mktemp -d)
  mkdir -p "$site/expertcache"
  touch "$site/expertcache/__init__.py"
  for d in trainer telemetry runtime evals recipes; do ln -s "$PWD/$d" "$site/expertcache/$d"; done
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY - <<'PY'
import sys, transformers
major = int(transformers.__version__.split(".")[0])
if major < 5:
    sys.exit(f"gpu_check: transformers {transformers.__version__} here; expertcache needs >= 5 (carry a wheel)")
PY
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec $PY scripts/gpu_check.py
