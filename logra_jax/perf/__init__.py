"""Measuring the stack, not running it: compiled-memory plans, profiles and matmul counts.

Only the benchmarks in ``launch/`` and the memory planner use these modules; the path from a config
to a trained policy never imports them (``tests/test_layering.py`` keeps that true).
"""
