#!/usr/bin/env python
"""Entry point of :mod:`benchmarks.vision_bytes` (its docstring says what it measures and how to run it)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.vision_bytes import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
