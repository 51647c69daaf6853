"""Roman numerals."""

_TABLE = [
    (1000, "M"), (500, "D"), (400, "CD"), (100, "C"),
    (90, "XC"), (50, "L"), (40, "XL"), (10, "X"),
    (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]


def to_roman(number):
    """The Roman numeral of an integer in [1, 3999]."""
    if not 1 <= number <= 3999:
        raise ValueError(f"number={number}: expected 1..3999")
    out = []
    for value, letters in _TABLE:
        while number >= value:
            out.append(letters)
            number -= value
    return "".join(out)


def from_roman(text):
    """The integer value of a Roman numeral."""
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, letter in enumerate(text):
        value = values[letter]
        if i + 1 < len(text) and values[text[i + 1]] > value:
            total -= value
        else:
            total += value
    return total
