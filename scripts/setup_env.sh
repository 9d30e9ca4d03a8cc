#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment at .venv and installs what a profile needs:
#   scripts/setup_env.sh demo   torch (CPU build, pinned), partita and the demo's needs
#                               (transformers, matplotlib): what scripts/demo.sh runs
#   scripts/setup_env.sh test   (the default) the above plus the `dev` extra: pytest, ruff, mypy,
#                               accelerate, peft, trl, mkdocs, tensorboard, DeepSpeed 0.19.8
# Both profiles share one .venv: `test` adds to a demo venv, and a test venv satisfies `demo`.
# Idempotent: a stamp per profile (a hash of pyproject.toml and setup.py) skips the install when
# nothing changed. Each step says what it installs and why; pip's own output shows for the long
# ones. Needs no network beyond PyPI: torch==2.13.0 resolves to this machine's CPU build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
profile="${1:-test}"
case "$profile" in
  demo) extra=demo ;;
  test) extra=dev ;;
  *) echo "setup_env.sh: unknown profile '$profile' (expected demo or test)" >&2; exit 2 ;;
esac
say() { echo "== setup ($profile): $* =="; }

want="$(cat "$root/pyproject.toml" "$root/setup.py" | sha256sum | cut -d' ' -f1)"
# The test profile keeps the stamp's historical name, so environments made before profiles
# existed are recognised.
test_stamp="$venv/.setup-stamp"
demo_stamp="$venv/.setup-stamp-demo"
stamp="$test_stamp"
[ "$profile" = demo ] && stamp="$demo_stamp"
up_to_date() { [ -f "$1" ] && [ "$(cat "$1")" = "$want" ]; }
if up_to_date "$test_stamp" || { [ "$profile" = demo ] && up_to_date "$demo_stamp"; }; then
  exit 0  # silent: the demo and the tests start at once
fi

started=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv ($(python3 --version))"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
# --no-compile: pip byte-compiles every .py it installs, and that was most of the time: torch
# installed in 113 s with it and 17 s without on this 2-core machine (2026-12-06); Python
# compiles what is imported on first import instead (import torch: 7.2 s then 6.3 s).
pip_install=("$py" -m pip install --no-compile)
say "upgrading pip in the venv (~2 MB)"
"${pip_install[@]}" -q --upgrade pip
# Pinned: an unpinned torch pulls a multi-GB CUDA build. On the same command line in every later
# step too, so that nothing that depends on torch swaps the build.
say "torch 2.13.0, CPU build (~190 MB wheel, ~750 MB installed with sympy and networkx)"
"${pip_install[@]}" "torch==2.13.0"
if [ "$profile" = demo ]; then
  say "partita (editable) + its demo extra: transformers (GPT-2), matplotlib (pictures) (~250 MB)"
else
  say "partita (editable) + its dev extra: the demo's, pytest, ruff, mypy, accelerate, peft," \
    "trl, mkdocs, tensorboard, DeepSpeed 0.19.8 from its sdist (~400 MB)"
fi
"${pip_install[@]}" -e "$root[$extra]" "torch==2.13.0"
echo "$want" > "$stamp"
say "done in $((SECONDS - started)) s; $venv holds $(du -sh "$venv" | cut -f1)"
