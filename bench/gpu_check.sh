#!/usr/bin/env bash
# The device check, one command on a bare GPU machine (Python 3.12 with torch, torchvision,
# numpy, pillow and pyyaml; no network, no venv, no systemd needed), at most 8 minutes:
#   bench/gpu_check.sh             on the GPU machine (after bench/fetch_gpu_wheels.sh here,
#                                  with .wheels/ copied along with the checkout)
#   bench/gpu_check.sh --dry-run   every stage on this CPU machine with tiny sizes (< 4 min)
# Writes "$OUT/gpu_check.json" (OUT defaults to bench/out) after every stage, so a timeout still
# leaves the figures so far. Exits non-zero when a stage fails, and when an NVIDIA GPU is
# present but CUDA cannot be used (with torch's own message).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: no Python at '$PY' (set PYTHON=/path/to/python3)" >&2
  exit 2
fi
site=""
# The wheels are for CPython 3.12 (the GPU machine's); another Python uses its own packages.
if compgen -G ".wheels/*.whl" >/dev/null \
    && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  # Wheels are zip files: unpacked they are importable as they are, no pip needed.
  site="$OUT/site"
  "$PY" - .wheels "$site" <<'PYEOF' || exit 2
import sys, zipfile
from pathlib import Path
wheels, site = Path(sys.argv[1]), Path(sys.argv[2])
stamp = site / ".wheels"
names = "\n".join(sorted(p.name for p in wheels.glob("*.whl")))
if not (stamp.is_file() and stamp.read_text() == names):
    site.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        zipfile.ZipFile(wheel).extractall(site)
    stamp.write_text(names)
PYEOF
  [ -d .wheels/photos ] && export INBOXD_PHOTOS_DIR="$PWD/.wheels/photos"
elif [ -d .wheels ]; then
  echo "gpu_check: $("$PY" -V) is not the 3.12 the wheels in .wheels/ are for: using its own packages"
fi
export PYTHONPATH="$PWD/daemon:$PWD${site:+:$(cd "$site" && pwd)}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec "$PY" -m bench.gpu_check --out "$OUT" "$@"
