"""Benchmarks: scripts that print figures and write JSON (`easel bench` is bench/easel_bench.py)."""
