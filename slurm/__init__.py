"""Slurm launch, paper sweeps and the scaling-table collector (python slurm/<tool>.py --help)."""
