"""Splitting text into words."""


def words(text):
    """The words of `text`, split on whitespace, without surrounding punctuation."""
    out = []
    for word in text.split(" "):
        word = word.strip(".,;:!?\"'()")
        if word:
            out.append(word)
    return out
