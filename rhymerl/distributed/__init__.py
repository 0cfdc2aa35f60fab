"""Ranks, devices and process groups; collectives and their device audit; time-sharing one
device between the rollout engine and training, and its memory plan."""
