"""partita's benchmarks, importable as a package: the tests reach a benchmark's pure pieces
through ``benchmarks.bench_x`` (pytest puts the checkout's root on ``sys.path``, see
``pythonpath`` in pyproject.toml).

Each ``bench_*.py`` also runs as a script, ``python benchmarks/bench_x.py`` (docs/benchmarks.md),
where this folder is ``sys.path[0]``: a module imports its siblings as
``benchmarks.common`` when it was imported from the package, else as ``common``.
"""
