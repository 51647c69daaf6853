import pytest

from units import convert


def test_c_to_f():
    assert convert.c_to_f(100) == 212


@pytest.mark.xfail(reason="kelvin is not supported yet", raises=AttributeError)
def test_kelvin():
    assert convert.c_to_k(0) == 273.15
