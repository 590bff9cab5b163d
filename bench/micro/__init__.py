"""Micro-benchmarks: each measures what one design decision rests on (its docstring says which)."""
