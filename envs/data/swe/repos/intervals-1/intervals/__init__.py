"""Small helpers for closed integer intervals [start, end]."""

from intervals.merge import merge, total_length

__all__ = ["merge", "total_length"]
