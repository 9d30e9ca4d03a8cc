#!/usr/bin/env bash
# Runs the whole test suite in the project virtual environment (set up on first use), then the
# four-rank parity tests again with torch's kernels, oneDNN and MKL held to AVX2: a summation
# order that differs with the vector width must show here, not on a user's AVX2-only CPU.
# With arguments, runs only `pytest -q ARGS` (default dispatch).
# The test profile of the set-up adds the dev tools (pytest, ruff, mypy, DeepSpeed, ...) to
# whatever .venv holds, a demo venv included.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" test
cd "$root"
python="$root/.venv/bin/python"
# Bytecode for partita and the tests, written once: every rank process imports them, and with
# PYTHONDONTWRITEBYTECODE set (as in some CI images) each would compile them from source again
# (partita.api imported in 0.67-0.81 s without bytecode, 0.37 s with, 2026-12-04).
# compileall writes the files whatever that variable says.
"$python" -m compileall -q "$root/src" "$root/tests" > /dev/null
# The same for the venv's packages, lazily: the set-up installs them without bytecode (pip
# --no-compile, 17 s instead of 113 s for torch), and with PYTHONDONTWRITEBYTECODE set no
# interpreter would ever write it, so every rank, launch and `python -c` of the suite compiled
# torch, sympy, transformers... from source: `import torch, torch._dynamo` took 10.6 s of CPU
# without bytecode and 3.8 s with it (2026-12-07). Unset here, the first import of a module
# writes its bytecode into .venv (this checkout's own) and every later interpreter reads it.
unset PYTHONDONTWRITEBYTECODE
if [ "$#" -gt 0 ]; then
  exec "$python" -m pytest -q "$@"
fi
# Test files run two at a time (pytest-xdist, one worker per file: a module's fixtures and the
# grids it spawns stay in one process). On two cores the serial suite kept the CPUs 107-160%
# busy, waiting on collectives and start-ups; a subset of 48 tests took 793 s serially and 622 s
# with two workers (2026-12-07). PARTITA_TEST_WORKERS sets the count (0: serial). Files go out
# in collection order, which tests/conftest.py starts with the longest files.
workers="${PARTITA_TEST_WORKERS:-2}"
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
"$python" -m pytest -q "${parallel[@]}"
# On a CPU without AVX-512 the run above already used AVX2 kernels (torch, oneDNN and MKL pick
# the widest ISA the CPU has), so the forced run would repeat it exactly: skip it there.
capability="$("$python" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
if [ -r /proc/cpuinfo ] && ! grep -qi avx512 /proc/cpuinfo && [ "$capability" != AVX512 ]; then
  echo "== parity tests under AVX2 dispatch: already run above (torch dispatch $capability, no AVX-512 in /proc/cpuinfo) =="
  exit 0
fi
# The forced run covers the four-rank parity grids (where an AVX2-only CPU once failed) to keep
# the suite within its time budget; AVX2_PARITY=all runs every parity test.
select=(-m parity -k "4]")
[ "${AVX2_PARITY:-}" = all ] && select=(-m parity)
echo "== parity tests again, dispatch held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS): ${select[*]} =="
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
  exec "$python" -m pytest -q "${parallel[@]}" "${select[@]}"
