import unittest

from slugs import slugify


class SlugifyTests(unittest.TestCase):

    def test_simple(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_digits(self):
        self.assertEqual(slugify("Python 3 rocks"), "python-3-rocks")

    def test_custom_separator(self):
        """A custom separator joins the words."""
        self.assertEqual(slugify("a b c", sep="_"), "a_b_c")
