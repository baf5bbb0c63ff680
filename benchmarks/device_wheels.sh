#!/usr/bin/env bash
# The Python packages `lqe serve` needs that the GPU machine's image lacks (its list: /work/.library/device/KINDS.md;
# it has anyio, h11, click, httpx, annotated-doc and prometheus-client, not these), as wheels for its Python 3.12
# x86-64, into .whl/ (git-ignored). Run here, before a device call that serves (the engine stage's "serving" step),
# and name ".whl" in that call's `carry`; benchmarks/stages/engine.sh installs them into a folder of their own on the
# device (pip --no-index --no-deps --target) when `import fastapi` fails there. About 3 MB.
#   bash benchmarks/device_wheels.sh            # .whl/
#   bash benchmarks/device_wheels.sh DIR        # DIR
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
# pinned: one version of each (two would stop the install), the ones the CPU suite runs the server with
pkgs=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 uvicorn==0.54.0
      annotated-types==0.8.0 typing-inspection==0.4.2 typing_extensions==4.16.0 opentelemetry-api==1.45.2)
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${pkgs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
n=$(ls "$dest"/*.whl 2>/dev/null | wc -l)
if (( n < ${#pkgs[@]} )); then
  echo "device_wheels: only $n of ${#pkgs[@]} wheels in $dest (pip could not fetch the rest)" >&2
  exit 1
fi
echo "device_wheels: $n wheels in $dest ($(du -sh "$dest" | cut -f1)); carry \"$dest\" in the device call"
