"""Turning titles into URL slugs."""

import re


def slugify(text, sep="-"):
    """Lowercase `text` and join its runs of letters and digits with `sep`.

    >>> slugify("Hello, World!")
    'hello-world'
    """
    words = re.split(r"[^a-z0-9]+", text.lower())
    return sep.join(words)
