"""Experiments as Python files with `get_config(arg=None) -> ml_collections.ConfigDict`, all
starting from `base.base_config()` (every field, its default and a one-line comment)."""
