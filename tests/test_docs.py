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


LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def _slug(header: str) -> str:
    """GitHub's anchor of a markdown header."""
    text = re.sub(r'[^\w\- ]', '', header.strip().lower())
    return text.replace(' ', '-')


def _anchors(path: str) -> set[str]:
    with open(path, encoding='utf-8') as f:
        return {_slug(line.lstrip('#')) for line in f if line.startswith('#')}


@pytest.mark.parametrize('path', DOCS, ids=[os.path.relpath(p, ROOT) for p in DOCS])
def test_every_link_stays_in_the_repository_and_finds_its_target(path):
    """The project stands alone: a relative link names a file of this repository (and a header of it, when it has
    an anchor); nothing points above the repository root."""
    root = os.path.realpath(ROOT)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    for target in LINK.findall(text):
        if re.match(r'^[a-z]+:', target):  # http(s), mailto: outside links are fine
            continue
        file, _, anchor = target.partition('#')
        resolved = os.path.realpath(os.path.join(os.path.dirname(path), file)) if file else os.path.realpath(path)
        assert resolved.startswith(root + os.sep), f'{path}: {target} points outside the repository'
        assert os.path.exists(resolved), f'{path}: {target}: no such file'
        if anchor and resolved.endswith('.md'):
            assert anchor in _anchors(resolved), f'{path}: {target}: no such header'


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        lines = f.read().split('\n')
    assert len(lines) <= 250, f'README.md: {len(lines)} lines'
    assert '../shared' not in '\n'.join(lines)
