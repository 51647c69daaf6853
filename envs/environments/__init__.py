"""Environments: what a sandbox starts from, described once and built for every backend.

This package owns
- `debian`: cached Debian root filesystems (mmdebstrap) and their Docker images;
- `cache`: the content-addressed, atomic build cache they share (ARBOR_ENV_CACHE).
"""
