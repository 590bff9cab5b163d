"""Serving logic that needs no Triton: routing between replicas, the load and preview boards, /dev/shm files."""
