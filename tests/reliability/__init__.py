"""Reliability suite: crashes, faults, races and hostile input (docs/reliability.md)."""
