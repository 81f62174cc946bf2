"""Every shipped YAML in configs/ is valid: the pack section parses and every other key is an ms-swift setting."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from swift_dynamic_callbacks.cli import prepare

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '..', 'configs', '*.yaml')))


def test_there_are_shipped_configs():
    assert CONFIGS


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_shipped_config_is_valid(path):
    from swift.arguments import SftArguments
    config, pack = prepare(path, [])
    allowed = {f.name for f in dataclasses.fields(SftArguments)}
    unknown = sorted(set(config) - allowed)
    assert not unknown, f'{path}: not ms-swift settings: {unknown}'
    for name in config.get('callbacks', []):
        pack.callback_config(name)  # raises ConfigError on bad settings
    with open(path, encoding='utf-8') as f:
        header = f.read().split('\n', 8)
    assert any('swift-dynamic sft configs/' in line for line in header), 'header comment must give the command'
