"""`easel bench`: the benchmark harness (Easel through tritonserver against diffusers, same run), its report, models and soak."""
