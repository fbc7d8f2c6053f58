"""Probe wing: one rank of a configured job run on fake tensors, its memory per category and phase beside the estimate."""
