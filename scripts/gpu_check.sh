#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): one run of at most 8 minutes on one GPU that writes
# gpu_check.json and gpu_check.md into $OUT (or the folder given with --out) and exits non-zero
# when any correctness case fails. Arguments go to benchmarks/gpu_check.py (--dry-run,
# --sections 1,1r,2,3,4, --perturb parity, --budget-s S).
#
# Which Python runs it (the GPU machine has no internet, so nothing may need downloading):
#   1. An existing CUDA-capable Python: $PYTHON if set, else python3, else python, the first
#      for which `import torch; torch.cuda.is_available()` is true. A virtual environment
#      ($GPU_CHECK_VENV, default /tmp/partita-gpu-venv, outside the work tree) is made from it
#      with --system-site-packages --without-pip (it sees that torch, pip, and deepspeed where
#      installed; that Python itself is used if no venv can be made) and partita is installed
#      into it with `pip install -e . --no-deps --no-build-isolation` (no index needed). Should
#      pip fail, src/ on PYTHONPATH stands in. partita's own dependencies (pydantic, hjson,
#      psutil, safetensors, tqdm, numpy) must be importable: wheels in $GPU_CHECK_WHEELS
#      (default .whl/, made here by scripts/gpu_wheels.sh for a machine without an index)
#      are installed to a folder on PYTHONPATH first; if one is still missing, pip is asked
#      for it (where an index is reachable) and the script stops naming it otherwise. When
#      that python is itself a venv's, it is used directly (a venv of a venv would not see
#      its packages).
#   2. No CUDA anywhere: scripts/setup_env.sh's .venv (CPU torch), and the dry run: every case
#      on CPU at tiny sizes, without a time box (what CI runs through tests/test_gpu_check.py).
#
# Time: GPU_CHECK_LIMIT_S (default 480) bounds the whole run from this script's start. The
# check is told the time left after set-up minus a margin (--budget-s: no case starts after
# it; the speed section's remaining rows become "not run (time)"); past the limit itself it
# gets SIGINT, still writes its report, and is killed 15 s later if it has not.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$(date +%s)
limit="${GPU_CHECK_LIMIT_S:-480}"

cuda_python=""
for cand in "${PYTHON:-}" python3 python; do
  if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 &&
    "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cuda_python="$(command -v "$cand")"
    break
  fi
done

extra=()
if [ -n "$cuda_python" ]; then
  py="$cuda_python"
  # A venv made from a venv's python sees the base interpreter's packages, not that venv's
  # (the H200 image's torch lives in /opt/torch/.venv): then that python itself is used.
  if "$cuda_python" -c 'import sys; sys.exit(0 if sys.prefix == sys.base_prefix else 1)'; then
    venv="${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/partita-gpu-venv}"
    # --without-pip: no ensurepip needed; the system's pip, seen through the system site
    # packages, installs into the venv.
    if [ ! -x "$venv/bin/python" ] &&
      ! "$cuda_python" -m venv --system-site-packages --without-pip "$venv"; then
      echo "gpu_check.sh: cannot make a venv; using $cuda_python itself" >&2
    fi
    [ -x "$venv/bin/python" ] && py="$venv/bin/python"
  fi
  # Wheels carried in (scripts/gpu_wheels.sh fills $GPU_CHECK_WHEELS, default .whl/, with
  # partita's pure-python dependencies and DeepSpeed) go to a folder on PYTHONPATH: no
  # index is needed, and nothing of the image is replaced.
  wheels="${GPU_CHECK_WHEELS:-$root/.whl}"
  if compgen -G "$wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/partita-gpu-site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
      "$wheels"/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! "$py" -c 'import partita' >/dev/null 2>&1; then
    "$py" -m pip install -q --no-deps --no-build-isolation -e "$root" ||
      echo "gpu_check.sh: pip install -e . failed; using src/ on PYTHONPATH" >&2
  fi
  export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
  missing="$("$py" - <<'PY'
import importlib.util
mods = ["pydantic", "hjson", "psutil", "safetensors", "tqdm", "numpy"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)"
  if [ -n "$missing" ]; then
    echo "gpu_check.sh: missing $missing; trying pip" >&2
    # shellcheck disable=SC2086
    "$py" -m pip install -q $missing || {
      echo "gpu_check.sh: cannot import $missing with $cuda_python and pip cannot fetch them" >&2
      exit 2
    }
  fi
  echo "gpu_check.sh: $py (torch from $cuda_python)"
else
  bash "$root/scripts/setup_env.sh"
  py="$root/.venv/bin/python"
  extra=(--dry-run)
  echo "gpu_check.sh: no CUDA-capable python found; dry run with $py"
fi

cd "$root"
if [ "${#extra[@]}" -gt 0 ]; then  # the dry run: every case, no time box
  exec "$py" benchmarks/gpu_check.py "${extra[@]}" "$@"
fi
left=$((limit - ($(date +%s) - start)))
budget=$((left - 40))  # margin: the last case may overrun its estimate, then the report
if [ "$budget" -lt 30 ]; then
  echo "gpu_check.sh: set-up took $((limit - left)) s of the ${limit} s limit" >&2
  exit 2
fi
exec timeout --signal=INT --kill-after=15 "$left" \
  "$py" benchmarks/gpu_check.py --budget-s "$budget" "$@"
