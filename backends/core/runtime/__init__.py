"""UNet runtimes behind one contract (base.py): the split UNet, its artifacts and specs, eager and fast torch."""
