"""Adapters: the store, LoRAs (loading in processes, merging in place, unmerged terms), ControlNets and their cache."""
