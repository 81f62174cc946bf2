"""The project's install never builds from source: every extra resolves, on a fresh environment, to wheels (beyond the
few sdists ms-swift itself pulls in), so ``pip install -e '.[<extra>]'`` never compiles anything a user did not ask
for (at 03097fd the ``demo`` extra resolved to ``llm`` and a source build of ``llama-cpp-python``)."""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
#: pure-Python sdists an extra may add, and why: nothing in them is compiled at install
ALLOWED_SDISTS = {'deepspeed': 'DeepSpeed publishes no wheel; without DS_BUILD_OPS its sdist compiles nothing'}
#: the sdists ms-swift 4.6's own dependencies bring (resolved for `torch==2.13.0 ms-swift==4.6.0 -e .` alone, by this
#: test's first version): not an extra's doing
SWIFT_SDISTS = {'oss2', 'crcmod', 'transformers-stream-generator'}


def _sdists(requirement: str, report: str) -> set[str]:
    """The packages pip would install from a source distribution to satisfy ``requirement`` in a fresh environment: a
    dry run of this environment's pip that ignores what is installed (the same resolution as a new venv's, measured:
    138 packages, the same versions; 30 s where a new venv's bundled pip 23.2 took 74 s)."""
    result = subprocess.run([sys.executable, '-m', 'pip', 'install', '--dry-run', '--quiet', '--ignore-installed',
                             '--report', report, 'torch==2.13.0', 'ms-swift==4.6.0', requirement],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(report, encoding='utf-8') as f:
        installs = json.load(f)['install']
    return {i['metadata']['name'].lower() for i in installs
            if not i['download_info']['url'].endswith('.whl') and not i['download_info']['url'].startswith('file:')}


@pytest.mark.e2e
def test_every_extra_resolves_without_a_source_build(tmp_path):
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, 'setup.cfg'))
    extras = sorted(parser['options.extras_require'])
    assert {'demo', 'vl', 'grpo', 'deepspeed', 'test'} <= set(extras)
    added = _sdists(f'{ROOT}[{",".join(extras)}]', str(tmp_path / 'extras.json')) - SWIFT_SDISTS
    assert added <= set(ALLOWED_SDISTS), f'extras {extras} resolve to source builds: {sorted(added)}'


@pytest.mark.e2e
def test_the_wheel_holds_its_data_and_builds_without_warnings(tmp_path):
    """The wheel carries the vendored assets and the ms-swift settings table, and setuptools warns about nothing (at
    03097fd three warnings: the asset folders missing from ``packages``)."""
    import zipfile
    result = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-v', '--no-deps', '--no-build-isolation', '-w',
                             str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines()
             if ('Warning' in line or 'would be ignored' in line) and 'Location' not in line]
    assert not lines, lines
    [wheel] = [p for p in os.listdir(tmp_path) if p.endswith('.whl')]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    for needed in ('swift_dynamic_callbacks/config/swift_args.json', 'swift_dynamic_callbacks/assets/gsm8k/LICENSE',
                   'swift_dynamic_callbacks/assets/qwen2.5-tokenizer/tokenizer.json.gz'):
        assert needed in names, needed
