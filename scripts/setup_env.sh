#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment at .venv and installs torch (pinned to the
# CPU build on this machine) and partita with its dev extras. Idempotent: a stamp of
# pyproject.toml skips the install when nothing changed. Source it or run it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp="$venv/.setup-stamp"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # Pinned: an unpinned torch pulls a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -e "$root[dev]" "torch==2.13.0"
  echo "$want" > "$stamp"
fi
