import pytest

from roman import from_roman, to_roman


@pytest.mark.parametrize("number,text", [(1, "I"), (4, "IV"), (9, "IX"), (14, "XIV"),
                                         (40, "XL"), (90, "XC"), (400, "CD")])
def test_to_roman_small(number, text):
    assert to_roman(number) == text


def test_from_roman():
    assert from_roman("MCMXCIV") == 1994


def test_round_trip():
    for n in range(1, 4000):
        assert from_roman(to_roman(n)) == n


def test_out_of_range():
    with pytest.raises(ValueError):
        to_roman(0)
