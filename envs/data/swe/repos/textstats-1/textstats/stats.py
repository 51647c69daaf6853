"""Statistics over the words of a text."""

from textstats.tokenize import words


def word_count(text):
    """Number of words in `text`."""
    return len(words(text))


def average_word_length(text):
    """Mean length of the words of `text` (0.0 for a text without words)."""
    ws = words(text)
    if not ws:
        return 0.0
    return sum(len(w) for w in ws) / len(ws)


def longest_word(text):
    """The first longest word of `text`, or "" if there is none."""
    return max(words(text), key=len, default="")
