"""Shared fixtures: tiny models built offline at test time, vendored real data, an ms-swift run helper."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


@pytest.fixture(scope='session')
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp('fixtures')


@pytest.fixture(scope='session')
def tiny_qwen(fixture_dir):
    from swift_dynamic_callbacks.tiny import build_tiny_model
    return str(build_tiny_model(fixture_dir / 'tiny-qwen2', 'qwen2'))


@pytest.fixture(scope='session')
def tiny_llama(fixture_dir):
    from swift_dynamic_callbacks.tiny import build_tiny_model
    return str(build_tiny_model(fixture_dir / 'tiny-llama', 'llama'))


@pytest.fixture(scope='session')
def gsm8k_16(fixture_dir):
    from swift_dynamic_callbacks.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-16.jsonl', 16))
