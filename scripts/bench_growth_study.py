#!/usr/bin/env python
"""Entry point of :mod:`benchmarks.growth_study` (its docstring says what it measures and how to run it)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.growth_study import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
