"""The examples a newcomer meets run as written, on CPU, offline, from a fresh clone's working directory: the
README's Python example, and the demo ``swift pt`` and DPO configs after ``swift-dynamic prepare-demo`` (their
headers' commands, verbatim)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from swift_runs import read_jsonl

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))


def _run(args, cwd, timeout=600):
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([ROOT] + [p for p in sys.path if p])}
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, (args, result.stderr[-3000:])
    return result


def _python_example() -> str:
    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        text = f.read()
    section = text[text.index('## Or in Python'):]
    return re.search(r'```python\n(.*?)```', section, re.S).group(1)


@pytest.mark.e2e
def test_the_readme_python_example_runs_as_written(tmp_path):
    _run([sys.executable, '-c', _python_example()], cwd=tmp_path)
    [log] = glob.glob(str(tmp_path / 'output' / 'example' / '*' / 'logging.jsonl'))  # ms-swift adds a version folder
    logs = [row for row in read_jsonl(log) if 'loss' in row]
    assert logs[0]['dynamic/batch_size'] == 2 and logs[-1]['dynamic/batch_size'] == 4  # the schedule: 2, then 4
    assert os.path.isdir(os.path.join(os.path.dirname(log), 'checkpoint-8'))


@pytest.fixture(scope='module')
def demo_root(tmp_path_factory):
    """A checkout-like folder: ``configs/`` copied and ``swift-dynamic prepare-demo .cache/demo --rows 128`` run in it
    (once for the module)."""
    root = tmp_path_factory.mktemp('demo-root')
    shutil.copytree(os.path.join(ROOT, 'configs'), root / 'configs')
    _run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'prepare-demo', '.cache/demo', '--rows', '128'],
         cwd=root)
    return root


@pytest.mark.e2e
@pytest.mark.parametrize('config,command,steps', [('demo_pt_lora_length_batching.yaml', 'pt', 12),
                                                  ('demo_dpo_lora_batch_growth.yaml', 'rlhf', 8)])
def test_the_demo_configs_run_as_their_headers_say(config, command, steps, demo_root):
    """``swift-dynamic prepare-demo .cache/demo --rows 128`` then ``swift-dynamic <command> configs/<file>`` from the
    repository root (a copy of ``configs/`` here): the raw-text pretraining example and the DPO example train."""
    with open(os.path.join(ROOT, 'configs', config), encoding='utf-8') as f:
        header = f.read()
    assert 'swift-dynamic prepare-demo .cache/demo --rows 128' in header
    assert f'swift-dynamic {command} configs/{config}' in header
    _run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', command, f'configs/{config}'], cwd=demo_root)
    out = 'demo_pt' if command == 'pt' else 'demo_dpo'
    logs = [row for row in read_jsonl(str(demo_root / 'output' / out / 'logging.jsonl')) if 'loss' in row]
    assert len(logs) == steps
