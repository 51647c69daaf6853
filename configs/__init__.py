"""Experiments as Python files with `get_config(arg=None) -> ml_collections.ConfigDict`."""
