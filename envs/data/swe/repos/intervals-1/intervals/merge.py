"""Merging closed intervals."""


def merge(intervals):
    """Merge overlapping or touching closed intervals.

    >>> merge([[1, 3], [2, 6], [8, 10]])
    [[1, 6], [8, 10]]
    """
    result = []
    for start, end in sorted(intervals):
        if result and start < result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


def total_length(intervals):
    """Total length covered by the intervals (overlaps counted once)."""
    return sum(end - start for start, end in merge(intervals))
