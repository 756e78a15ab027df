#!/usr/bin/env bash
# The GPU checks of issue 5 in one go: `pytest -m gpu`, then the bench with GPU sizes (0.3-MP
# JPEGs, 6,000-file flood), writing bench.txt/.json/.png under "$OUT" (default bench/out).
# Budget: under 8 minutes on one H200. Installs nothing. Without a CUDA GPU it says so and
# exits 0, so it can run (and be checked) anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to torch here; skipping the GPU tests and the GPU bench."
  exit 0
fi
"$PY" - <<'PYEOF' | tee "$OUT/gpu_env.txt"
import torch
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__,
      "| cuda", torch.version.cuda)
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/gpu_env.txt" 2>&1

status=0
# Each part has its own deadline so one hang cannot eat the whole budget (8 minutes in all).
timeout 150 "$PY" -m pytest -m gpu -p no:cacheprovider -q 2>&1 | tee "$OUT/gpu_pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: pytest -m gpu failed"; status=1; }
timeout 300 "$PY" -m bench.run --profile gpu --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: the GPU bench failed"; status=1; }
echo "gpu_check: results under $OUT (bench.txt, bench.json, bench.png, gpu_pytest.txt)"
exit "$status"
