"""URL slugs from titles."""

from slugs.text import slugify

__all__ = ["slugify"]
