"""Benchmark results (results/) and micro-benchmarks (micro/); the harness is `easel bench` (clients/bench/)."""
