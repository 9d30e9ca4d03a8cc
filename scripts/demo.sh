#!/usr/bin/env bash
# Trains the demo GPT on the text shipped in data/ with 2 CPU processes. On first use it sets up
# .venv with only what the demo needs (scripts/setup_env.sh demo: torch CPU, partita,
# transformers, matplotlib; about 1.2 GB, a few minutes), saying what it installs.
# Extra arguments go to the training script, e.g. scripts/demo.sh --steps 100; NPROCS=4 uses 4
# processes. The run's log, loss curve and memory picture go to runs/demo-<UTC time>/ (--out_dir
# to choose; examples/train_gpt.py --help lists every option).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" demo
cd "$root"
# The set-up installs packages without bytecode (fast); let the first run write it into .venv
# even where PYTHONDONTWRITEBYTECODE is set, or every run compiles torch again (scripts/test.sh).
unset PYTHONDONTWRITEBYTECODE
nprocs="${NPROCS:-2}"
exec "$root/.venv/bin/partita" --num_procs "$nprocs" examples/train_gpt.py \
  --deepspeed_config examples/ds_config.json "$@"
