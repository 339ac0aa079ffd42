"""Fills the Plan's estimates (memory, communication, pipeline, time)."""

from __future__ import annotations


def fill(plan, spec) -> None:
    """Foundation version: no estimates yet (the planner issue builds memory.py / perf.py)."""
    return None
