"""Temperature conversions between Celsius and Fahrenheit."""


def c_to_f(celsius):
    """Degrees Fahrenheit of a Celsius temperature."""
    return celsius * 9 / 5 + 32


def f_to_c(fahrenheit):
    """Degrees Celsius of a Fahrenheit temperature."""
    return fahrenheit - 32 * 5 / 9
