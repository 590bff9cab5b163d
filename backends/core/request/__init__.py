"""What a request is: validated parameters and limits, the Triton I/O contract, adapter inputs. Torch-free."""
