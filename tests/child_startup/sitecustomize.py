"""Test speed only: ``tests/speedups.py`` in every Python process the tests start (this folder is on their
``PYTHONPATH``: ``conftest.py`` puts it there). It patches ``datasets`` only if the process imports it."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    '_sdc_test_speedups', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'speedups.py'))
_speedups = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_speedups)
_speedups.install_on_import()
