"""Triton glue: the Python backend adapter, the BLS pipeline and ControlNet calls, metrics."""
