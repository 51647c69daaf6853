from textstats.stats import average_word_length, longest_word, word_count


def test_word_count_simple():
    assert word_count("the quick brown fox") == 4


def test_word_count_punctuation():
    assert word_count("Hello, world!") == 2


def test_average_word_length():
    assert average_word_length("ab abcd") == 3.0
    assert average_word_length("") == 0.0
