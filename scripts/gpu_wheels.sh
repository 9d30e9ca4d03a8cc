#!/usr/bin/env bash
# Fills a wheel folder (default .whl/, git-ignored through .git/info/exclude) for a GPU
# machine without an index: partita's dependencies that its CUDA image lacks (pydantic and
# its own dependencies, hjson) as CPython 3.12 x86-64 wheels, at the versions this checkout's
# .venv runs, and DeepSpeed (a pure-python wheel built here from its sdist without ops: they
# compile on the GPU machine). scripts/gpu_check.sh installs them from $GPU_CHECK_WHEELS.
#   bash scripts/gpu_wheels.sh [DIR]      then carry DIR (".whl") to the GPU machine
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.whl}"
py="$root/.venv/bin/python"
[ -x "$py" ] || bash "$root/scripts/setup_env.sh"
mkdir -p "$dir"
grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$root/.git/info/exclude"

version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions hjson; do
  pins+=("$name==$(version "$name")")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" "${pins[@]}"
if "$py" -c 'import deepspeed' 2>/dev/null; then
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" \
    "deepspeed==$(version deepspeed)"
fi
ls -1 "$dir"
