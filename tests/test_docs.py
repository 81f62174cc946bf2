"""Every YAML example in README.md and docs/ is a file ``swift-dynamic check`` accepts, with only ms-swift settings
beside ``dynamic_callbacks:``; an example that cannot be one says why on the line before its fence
(``<!-- fragment: WHY -->``). docs/architecture.md's module table names every module of the package, and every
module it names exists."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import pytest
import yaml

from swift_dynamic_callbacks.cli import main as cli_main

ROOT = os.path.join(os.path.dirname(__file__), '..')
DOCS = [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
FRAGMENT = re.compile(r'<!--\s*fragment:\s*(.*?)\s*-->')


def yaml_blocks() -> list[tuple[str, str, str | None]]:
    """``(where, text, why it is a fragment or None)`` for every ```yaml block."""
    blocks = []
    for path in DOCS:
        with open(path, encoding='utf-8') as f:
            lines = f.read().split('\n')
        start = None
        for i, line in enumerate(lines):
            if start is None and line.strip() == '```yaml':
                start = i
            elif start is not None and line.strip() == '```':
                marker = FRAGMENT.search(lines[start - 1]) if start else None
                where = f'{os.path.relpath(path, ROOT)}:{start + 1}'
                blocks.append((where, '\n'.join(lines[start + 1:i]), marker.group(1) if marker else None))
                start = None
    return blocks


BLOCKS = yaml_blocks()


def test_the_docs_have_yaml_examples():
    assert len(BLOCKS) >= 10 and any(b[0].startswith('README.md') for b in BLOCKS)


@pytest.mark.parametrize('where, text, why', BLOCKS, ids=[b[0] for b in BLOCKS])
def test_yaml_example_is_checked(where, text, why, tmp_path, capsys):
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f'{where}: not a YAML mapping'
    if why is not None:
        assert len(why) > 20, f'{where}: a fragment must say why it is not a complete file'
        return
    from swift.arguments import RLHFArguments, SftArguments
    allowed = {f.name for cls in (SftArguments, RLHFArguments) for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - allowed - {'dynamic_callbacks'})
    assert not unknown, f'{where}: not ms-swift settings: {unknown}'
    path = tmp_path / 'example.yaml'
    path.write_text(text, encoding='utf-8')
    code = cli_main(['check', str(path)])
    assert code == 0, f'{where}: swift-dynamic check refused it: {capsys.readouterr().err}'


def test_architecture_module_table_matches_the_package():
    with open(os.path.join(ROOT, 'docs', 'architecture.md'), encoding='utf-8') as f:
        text = f.read()
    named = set(re.findall(r'`(swift_dynamic_callbacks/[\w/]+\.py)`', text))
    package = os.path.join(ROOT, 'swift_dynamic_callbacks')
    modules = {os.path.relpath(p, ROOT).replace(os.sep, '/') for p in glob.glob(os.path.join(package, '**', '*.py'),
                                                                              recursive=True)}
    modules = {m for m in modules if not m.endswith('__init__.py')}
    folders = set(re.findall(r'`(swift_dynamic_callbacks/[\w/]+/)`', text))
    covered = {m for m in modules if any(m.startswith(folder) for folder in folders)}
    assert named <= modules, f'docs/architecture.md names modules that do not exist: {sorted(named - modules)}'
    missing = sorted(modules - covered - named)
    assert modules - covered <= named, f'modules docs/architecture.md does not name: {missing}'
