"""What `envs.taskgen` draws its tasks from: function families with their planted bugs,
parameter and module names, and the phrasings of the instruction.

Tables only; their order is part of the generator's output (the same (level, seed, index)
always gives the same task), so append to them rather than reorder.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Family:
  """A small function template. `body` and `bugs` use the placeholders of `params`."""

  names: tuple[str, ...]            # function names to choose from
  params: tuple[str, ...]           # placeholders, e.g. ("a", "b")
  pool: str                         # which parameter-name pool renames the placeholders
  body: str                         # lines of the body, "\n"-separated, unindented
  bugs: tuple[tuple[str, str], ...]  # (correct text, buggy text), each once in the body
  doc: str                          # docstring template
  draw: Callable[[random.Random], Any]  # one argument value
  kind: str                         # how a public function composes it: map | fold | pred


def _ints(lo, hi):
  return lambda r: r.randint(lo, hi)


def _int_list(lo, hi, n_lo=1, n_hi=5):
  return lambda r: [r.randint(lo, hi) for _ in range(r.randint(n_lo, n_hi))]


_WORDS = ("apple", "Banana", "kiwi", "Umbrella", "sky", "hello", "Python", "queue", "tree",
          "ocean", "Ice", "rhythm", "data", "Moon")


def _word(r):
  return r.choice(_WORDS)


FAMILIES = (
    # two numbers -> number (composed as a fold over a list)
    Family(("add", "add_numbers", "plus", "sum_two"), ("a", "b"), "pair", "return {a} + {b}",
           (("+", "-"), ("+", "*")), "Return the sum of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("subtract", "difference", "minus"), ("a", "b"), "pair", "return {a} - {b}",
           (("-", "+"), ("{a} - {b}", "{b} - {a}")), "Return {a} minus {b}.", _ints(-9, 9),
           "fold"),
    Family(("multiply", "product", "times"), ("a", "b"), "pair", "return {a} * {b}",
           (("*", "+"), ("*", "**")), "Return {a} multiplied by {b}.", _ints(0, 5), "fold"),
    Family(("larger", "max_of_two", "bigger"), ("a", "b"), "pair", "return max({a}, {b})",
           (("max", "min"),), "Return the larger of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("smaller", "min_of_two", "lesser"), ("a", "b"), "pair", "return min({a}, {b})",
           (("min", "max"),), "Return the smaller of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("distance", "abs_diff", "gap"), ("a", "b"), "pair", "return abs({a} - {b})",
           (("abs({a} - {b})", "({a} - {b})"), ("-", "+")),
           "Return the absolute difference of {a} and {b}.", _ints(-9, 9), "fold"),
    Family(("quotient", "int_divide"), ("a", "b"), "pair", "return {a} // {b}",
           (("//", "%"),), "Return {a} divided by {b}, rounded down.", _ints(1, 9), "fold"),
    # one number -> value (composed as a map over a list)
    Family(("double", "twice", "times_two"), ("x",), "one", "return {x} * 2",
           (("2", "3"), ("*", "+")), "Return {x} doubled.", _ints(-9, 9), "map"),
    Family(("square", "squared"), ("x",), "one", "return {x} * {x}",
           (("{x} * {x}", "{x} + {x}"),), "Return {x} squared.", _ints(-9, 9), "map"),
    Family(("increment", "add_one", "next_number"), ("x",), "one", "return {x} + 1",
           (("+ 1", "- 1"), ("1", "2")), "Return {x} plus one.", _ints(-9, 9), "map"),
    Family(("negate", "opposite"), ("x",), "one", "return -{x}", (("-{x}", "{x}"),),
           "Return {x} with its sign flipped.", _ints(-9, 9), "map"),
    Family(("absolute", "magnitude"), ("x",), "one", "return {x} if {x} >= 0 else -{x}",
           ((">=", "<="),), "Return the absolute value of {x}.", _ints(-9, 9), "map"),
    Family(("half", "halve"), ("x",), "one", "return {x} // 2", (("//", "*"),),
           "Return half of {x}, rounded down.", _ints(-9, 9), "map"),
    Family(("count_up", "one_to_n", "first_n_numbers"), ("x",), "count",
           "return list(range(1, {x} + 1))", (("{x} + 1", "{x}"), ("range(1", "range(0")),
           "Return the list [1, 2, ..., {x}].", _ints(0, 6), "map"),
    Family(("factorial",), ("x",), "count",
           "result = 1\nfor i in range(2, {x} + 1):\n    result *= i\nreturn result",
           (("{x} + 1", "{x}"), ("result = 1", "result = 0")), "Return {x}! (the factorial).",
           _ints(0, 7), "map"),
    # predicates (composed as a count over a list)
    Family(("is_positive",), ("x",), "one", "return {x} > 0", ((">", ">="), (">", "<")),
           "Return True if {x} is greater than zero.", _ints(-3, 3), "pred"),
    Family(("is_negative",), ("x",), "one", "return {x} < 0", (("<", "<="),),
           "Return True if {x} is below zero.", _ints(-3, 3), "pred"),
    Family(("is_even",), ("x",), "one", "return {x} % 2 == 0", (("==", "!="), ("2", "3")),
           "Return True if {x} is even.", _ints(-9, 9), "pred"),
    Family(("is_adult", "can_vote"), ("x",), "age", "return {x} >= 18",
           ((">=", ">"), ("18", "21")), "Return True if someone aged {x} is an adult (18+).",
           _ints(14, 23), "pred"),
    Family(("is_single_digit",), ("x",), "one", "return -10 < {x} < 10",
           (("< 10", "<= 10"),), "Return True if {x} has a single decimal digit.",
           _ints(-11, 11), "pred"),
    # list -> value (composed as a map over a list of lists)
    Family(("total", "sum_list", "sum_items"), ("xs",), "list",
           "result = 0\nfor v in {xs}:\n    result += v\nreturn result",
           (("result = 0", "result = 1"), ("+=", "-=")), "Return the sum of {xs}.",
           _int_list(-5, 9, 0, 4), "map"),
    Family(("last_item", "last", "final_element"), ("xs",), "list", "return {xs}[-1]",
           (("-1", "0"), ("-1", "-2")), "Return the last element of {xs}.",
           _int_list(0, 9), "map"),
    Family(("first_item", "first", "head"), ("xs",), "list", "return {xs}[0]",
           (("0", "1"), ("0", "-1")), "Return the first element of {xs}.", _int_list(0, 9),
           "map"),
    Family(("largest", "max_item", "biggest"), ("xs",), "list",
           "best = {xs}[0]\nfor v in {xs}:\n    if v > best:\n        best = v\nreturn best",
           ((">", "<"),), "Return the largest element of {xs}.", _int_list(-9, 9), "map"),
    Family(("reverse", "reversed_list", "backwards"), ("xs",), "list", "return {xs}[::-1]",
           (("[::-1]", "[1:]"),), "Return {xs} in reverse order.", _int_list(0, 9, 0, 4),
           "map"),
    Family(("count_positive", "num_positive"), ("xs",), "list",
           "return len([v for v in {xs} if v > 0])", ((">", ">="),),
           "Return how many elements of {xs} are greater than zero.", _int_list(-2, 3, 0, 5),
           "map"),
    # strings
    Family(("shout", "to_upper", "loud"), ("s",), "text", "return {s}.upper()",
           (("upper", "lower"),), "Return {s} in upper case.", _word, "map"),
    Family(("whisper", "to_lower", "quiet"), ("s",), "text", "return {s}.lower()",
           (("lower", "upper"),), "Return {s} in lower case.", _word, "map"),
    Family(("greet", "hello"), ("s",), "name", 'return "Hello, " + {s} + "!"',
           (('"!"', '"?"'), ('"Hello, "', '"Hello "')), "Return a greeting for {s}.", _word,
           "map"),
    Family(("first_letter", "initial"), ("s",), "text", "return {s}[0]", (("0", "-1"),),
           "Return the first character of {s}.", _word, "map"),
    Family(("count_vowels", "vowel_count"), ("s",), "text",
           'return sum(1 for c in {s}.lower() if c in "aeiou")',
           (('"aeiou"', '"aeio"'), (".lower()", "")),
           "Return the number of vowels (a, e, i, o, u) in {s}.", _word, "map"),
    Family(("word_length", "length_of"), ("s",), "text", "return len({s})",
           (("len({s})", "len({s}) - 1"),), "Return the number of characters in {s}.", _word,
           "map"),
)

# Parameter names per pool (placeholders are renamed in order).
POOLS = {
    "pair": (("a", "b"), ("x", "y"), ("m", "n"), ("left", "right"), ("first", "second"),
             ("p", "q")),
    "one": (("x",), ("n",), ("value",), ("num",), ("k",)),
    "count": (("n",), ("count",), ("limit",), ("k",)),
    "age": (("age",), ("years",)),
    "list": (("xs",), ("items",), ("values",), ("numbers",), ("seq",)),
    "text": (("s",), ("text",), ("word",)),
    "name": (("name",), ("who",), ("person",)),
}
MODULES = ("calc", "mathutils", "helpers", "utils", "toolbox", "funcs", "basics", "ops")
PACKAGES = ("mylib", "toolkit", "arith", "smallpkg", "corelib", "appcore", "minilib")
HELPER_MODULES = ("helpers", "primitives", "base", "impl")
API_MODULES = ("core", "api", "service", "logic")
LEVEL3_MODULES = (("numeric", "extras"), ("mathops", "moreops"), ("basic_ops", "misc"))

# Phrasings of the instruction per style, from expert to colloquial.
STATEMENTS = {
    "specific": (
        "`{call}` {result} but should return `{want}`. Fix `{func}` in `{file}` so that the "
        "tests in `{test_file}` pass (do not change the tests).",
        "The function `{func}` is wrong: `{call}` should be `{want}`, but it {result}. "
        "Please fix it.",
        "Bug report: {func} gives {got} for {call}; the expected result is {want}.",
        "Fix {func}: expected {call} == {want}, got {got}.",
        "{func} is broken lol, {call} gives me {got}?? should be {want}",
        "hey can you look at {func}? when i call {call} i get {got} instead of {want}",
    ),
    "indirect": (
        "`{call}` {result} instead of returning `{want}`. The public function `{func}` looks "
        "right, so the bug may be in a helper it relies on. Fix the code so that the tests in "
        "`{test_file}` pass (do not change the tests).",
        "`{func}` gives the wrong answer: `{call}` should be `{want}`, but it {result}. Find "
        "the bug and fix it.",
        "Bug report: {call} gives {got}, expected {want}.",
        "{func} is broken, {call} gives me {got} but i expected {want}. can you fix it?",
        "something's off with {func}, {call} should be {want} not {got}",
    ),
    "vague": (
        "`{func}` returns wrong results for some inputs, for example `{call}`. The tests in "
        "`{test_file}` show the expected behaviour. Find the bug and fix it without changing "
        "the tests.",
        "Some tests in `{test_file}` fail. Please fix the code, not the tests.",
        "{func} seems broken for some inputs, e.g. {call}. can you track it down and fix it?",
    ),
}
