"""Shared fixtures: tiny models built offline at test time, vendored real data, an ms-swift run helper."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def _speed_up_datasets() -> None:
    """Test speed only (``speedups.py``): ``datasets`` patched here and, through
    ``child_startup/sitecustomize.py`` on the ``PYTHONPATH``, in every Python process a test starts."""
    import speedups
    speedups.install()
    startup = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'child_startup')
    if startup not in sys.path:
        sys.path.append(startup)  # for the tests that build a child's PYTHONPATH from sys.path
    paths = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    if startup not in paths:
        os.environ['PYTHONPATH'] = os.pathsep.join([startup] + paths)


_speed_up_datasets()


@pytest.fixture(scope='session')
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp('fixtures')


@pytest.fixture(scope='session')
def tiny_qwen(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    return str(build_tiny_model(fixture_dir / 'tiny-qwen2', 'qwen2'))


@pytest.fixture(scope='session')
def tiny_llama(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    return str(build_tiny_model(fixture_dir / 'tiny-llama', 'llama'))


@pytest.fixture(scope='session')
def gsm8k_16(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-16.jsonl', 16))


def pytest_collection_modifyitems(config, items):
    """The tests marked ``start_first`` go first, the rest keep their order: a long test collected last kept one worker
    busy while the other had nothing left. The engine and vision-language stages mark their longest tests (``--dist
    load`` hands tests out in collection order); the default run marks its longest files whole (``--dist loadfile``
    hands out files in the order of their first test)."""
    items.sort(key=lambda item: item.get_closest_marker('start_first') is None)


def pytest_collection_finish(session):
    """Test speed only: every in-process ``swift sft`` run calls ``gc.collect()`` (accelerate's ``free_memory`` at the
    start of training), and with torch, transformers, ms-swift and the collected tests imported a full collection
    walks millions of long-lived objects (0.4 s a run). ``gc.freeze()`` moves the objects alive after collection out
    of the collector's sight; everything a test creates is collected as before."""
    import gc
    gc.collect()
    gc.freeze()
