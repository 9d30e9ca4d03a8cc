#!/usr/bin/env bash
# Runs the whole test suite in the project virtual environment (set up on first use).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
