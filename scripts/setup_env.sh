#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment at .venv and installs torch (pinned to the
# CPU build on this machine) and partita with its dev extras. Idempotent: a stamp of
# pyproject.toml and setup.py skips the install when nothing changed. Source it or run it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp="$venv/.setup-stamp"
want="$(cat "$root/pyproject.toml" "$root/setup.py" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # Pinned: an unpinned torch pulls a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -e "$root[dev]" "torch==2.13.0"
  echo "$want" > "$stamp"
fi
# DeepSpeed itself, for the tests that load checkpoints it writes (tests/test_deepspeed_checkpoints.py;
# they import it with DS_ACCELERATOR=cpu). Checked apart from the stamp so existing
# environments get it too; torch pinned on the same command line so pip keeps the CPU build.
if ! "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  "$venv/bin/python" -m pip install -q "deepspeed==0.19.8" "torch==2.13.0"
fi
