#!/usr/bin/env bash
# Runs a training benchmark (default: benchmarks/bench_dp.py, data parallel) after setting up
# the environment. Arguments go to the benchmark, e.g. scripts/bench.sh --model 124m --steps 20.
#   --with-deepspeed (or WITH_DEEPSPEED=1): first install deepspeed==0.19.8, torch kept pinned,
#       so the DeepSpeed rows run (its first run compiles C++ ops, about 2 minutes).
#   BENCH=NAME: run benchmarks/bench_NAME.py instead of bench_dp.py.
# Results: benchmarks/results/*.md and .json (dp_<model>, zero12_<model>, zero3_<model>...).
# Timings need a quiet machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
python="$root/.venv/bin/python"
with_deepspeed="${WITH_DEEPSPEED:-0}"
args=()
for arg in "$@"; do
  case "$arg" in
    --with-deepspeed) with_deepspeed=1 ;;
    *) args+=("$arg") ;;
  esac
done
if [ "$with_deepspeed" = 1 ] && ! DS_ACCELERATOR=cpu "$python" -c "import deepspeed" 2>/dev/null; then
  # Pinned torch on the same command line: deepspeed must not pull another torch build.
  "$python" -m pip install -q "deepspeed==0.19.8" "torch==2.13.0"
fi
cd "$root"
exec "$python" "benchmarks/bench_${BENCH:-dp}.py" "${args[@]}"
