from intervals import merge, total_length


def test_overlapping():
    assert merge([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]


def test_unsorted_input():
    assert merge([[8, 10], [1, 3], [2, 6]]) == [[1, 6], [8, 10]]


def test_empty():
    assert merge([]) == []


def test_touching_intervals_are_merged():
    assert merge([[1, 2], [2, 5]]) == [[1, 5]]


def test_total_length_with_touching():
    assert total_length([[0, 1], [1, 3], [5, 6]]) == 4
    assert len(merge([[0, 1], [1, 3], [5, 6]])) == 2
