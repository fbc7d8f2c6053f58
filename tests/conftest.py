"""Test tiers: unit/ (one process, seconds), dist/ (forked gloo ranks), slurm/ (a real local Slurm)."""
