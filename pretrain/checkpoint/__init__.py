"""Checkpoint wing: DCP save and resume, the manifest, the safe readers, and the export to one file."""
