#!/usr/bin/env bash
# Trains the demo GPT on the text shipped in data/ with 2 CPU processes (set up on first use).
# Extra arguments go to the training script, e.g. scripts/demo.sh --steps 100.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
nprocs="${NPROCS:-2}"
exec "$root/.venv/bin/partita" --num_procs "$nprocs" examples/train_gpt.py \
  --deepspeed_config examples/ds_config.json "$@"
