"""Pieces of ``benchmarks/gpu_check.py``: the GPU check's cases, its models and its report.

Run ``scripts/gpu_check.sh`` (or ``python benchmarks/gpu_check.py --dry-run``) rather than
importing these modules; see the script's docstring for what the check covers.
"""
