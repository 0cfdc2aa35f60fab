"""Ranks, devices, process groups and collectives; colocating the engine and training, and its memory plan."""
