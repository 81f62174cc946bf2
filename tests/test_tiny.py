"""Tests for the offline fixtures in swift_dynamic_callbacks.testing.tiny."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swift_dynamic_callbacks.testing import tiny

# per arch: vocabulary rows, (bos, eos, pad) ids, len(tokenizer), "Hello world" ids, tokenizer.json size
EXPECTED = {
    'qwen2': dict(vocab=151936, special=(None, 151645, 151643), tokens=151665, hello=[9707, 1879], size=7_031_645),
    'llama': dict(vocab=49152, special=(1, 2, 2), tokens=49152, hello=[19556, 905], size=3_522_871),  # SmolLM2
}


def _read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text(encoding='utf-8').splitlines()
    return [json.loads(line) for line in lines]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope='module')
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp('tiny_models')
    return {arch: tiny.build_tiny_model(root / arch, arch) for arch in tiny.ARCHS}


def test_assets_are_small_and_documented() -> None:
    files = [p for p in tiny.ASSETS.rglob('*') if p.is_file()]
    names = {p.relative_to(tiny.ASSETS).as_posix() for p in files}
    assert {
        'qwen2.5-tokenizer/tokenizer.json.gz', 'qwen2.5-tokenizer/tokenizer_config.json',
        'qwen2.5-tokenizer/NOTICE.md', 'smollm2-tokenizer/tokenizer.json.gz', 'smollm2-tokenizer/tokenizer_config.json',
        'smollm2-tokenizer/NOTICE.md', 'gsm8k/train-500.jsonl.gz', 'gsm8k/LICENSE', 'gsm8k/NOTICE.md'
    } <= names
    assert sum(p.stat().st_size for p in files) < 3_000_000
    with gzip.open(tiny.ASSETS / 'gsm8k' / 'train-500.jsonl.gz', 'rt', encoding='utf-8') as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == tiny.GSM8K_ROWS == 500
    assert all(set(r) == {'question', 'answer'} for r in rows)


def test_held_out_test_rows_are_vendored_and_disjoint_from_train(tmp_path: Path) -> None:
    test = _read_jsonl(tiny.write_gsm8k_dataset(tmp_path / 'test.jsonl', split='test'))
    train = _read_jsonl(tiny.write_gsm8k_dataset(tmp_path / 'train.jsonl'))
    assert len(test) == tiny.GSM8K_TEST_ROWS == 100
    assert test[0]['messages'][0]['content'].startswith('Janet')  # the first GSM8K test row
    questions = {row['messages'][0]['content'] for row in train}
    assert not any(row['messages'][0]['content'] in questions for row in test)  # held out
    with pytest.raises(ValueError, match=r"split must be 'train' or 'test', got split='dev'"):
        tiny.write_gsm8k_dataset(tmp_path / 'dev.jsonl', split='dev')
    with pytest.raises(ValueError, match=r'between 1 and 100 .*test.*got n=101'):
        tiny.write_gsm8k_dataset(tmp_path / 'big.jsonl', n=101, split='test')


def test_calculator_annotations_can_be_dropped(tmp_path: Path) -> None:
    """The main job trains on GSM8K answers without ``<<3*6=18>>``: the rest of each answer is kept as it was."""
    kept = _read_jsonl(tiny.write_gsm8k_dataset(tmp_path / 'kept.jsonl', n=20))
    plain = _read_jsonl(tiny.write_gsm8k_dataset(tmp_path / 'plain.jsonl', n=20, calculator=False))
    answers = [(k['messages'][1]['content'], p['messages'][1]['content']) for k, p in zip(kept, plain)]
    assert any('<<' in k for k, _ in answers) and not any('<<' in p or '>>' in p for _, p in answers)
    assert all(re.sub(r'<<[^>]*>>', '', k) == p and p.rstrip().split('#### ')[-1] == k.rstrip().split('#### ')[-1]
               for k, p in answers)


@pytest.mark.parametrize('arch', tiny.ARCHS)
def test_tokenizer_round_trip_and_idempotence(tmp_path: Path, arch: str) -> None:
    want = EXPECTED[arch]
    dest = tiny.materialize_tokenizer(tmp_path / 'tok', arch)
    assert dest == tmp_path / 'tok'
    tok = AutoTokenizer.from_pretrained(dest)
    ids = tok('Hello world', add_special_tokens=False)['input_ids']
    assert ids == want['hello']
    assert tok.decode(ids) == 'Hello world'
    assert tok('Hello world')['input_ids'] == ids  # no bos or eos added by the tokenizer itself
    assert len(tok) == want['tokens']
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == want['special']

    tok_json = dest / 'tokenizer.json'
    stamp = tok_json.stat().st_mtime_ns
    tiny.materialize_tokenizer(dest, arch)
    assert tok_json.stat().st_mtime_ns == stamp  # same size: left alone
    tok_json.write_bytes(b'{}')
    tiny.materialize_tokenizer(dest, arch)
    assert tok_json.stat().st_size == want['size']  # wrong size: rewritten
    with pytest.raises(ValueError, match=r"arch must be one of \['qwen2', 'llama'\], got arch='gpt2'"):
        tiny.materialize_tokenizer(dest, 'gpt2')


@pytest.mark.parametrize('arch', tiny.ARCHS)
def test_build_tiny_model_loads_and_gives_finite_loss(models: dict[str, Path], arch: str) -> None:
    dest = models[arch]
    model = AutoModelForCausalLM.from_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.vocab_size == EXPECTED[arch]['vocab']
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 2048)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == EXPECTED[arch]['special']
    assert cfg.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.dtype == torch.float32
    assert (dest / 'model.safetensors').is_file() and (dest / 'generation_config.json').is_file()

    ids = tok('Natalia sold clips to 48 of her friends.', return_tensors='pt')['input_ids']
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert math.isfinite(loss)
    assert abs(loss - math.log(cfg.vocab_size)) < 1.0  # random init: close to uniform


def test_build_tiny_model_is_seeded_and_idempotent(tmp_path: Path) -> None:
    kwargs = dict(hidden_size=16, num_layers=1)
    a = tiny.build_tiny_model(tmp_path / 'a', seed=3, **kwargs)
    b = tiny.build_tiny_model(tmp_path / 'b', seed=3, **kwargs)
    c = tiny.build_tiny_model(tmp_path / 'c', seed=4, **kwargs)
    weights = {d: _sha256(d / 'model.safetensors') for d in (a, b, c)}
    assert weights[a] == weights[b] != weights[c]

    stamp = (a / 'model.safetensors').stat().st_mtime_ns
    assert tiny.build_tiny_model(a, seed=3, **kwargs) == a
    assert (a / 'model.safetensors').stat().st_mtime_ns == stamp  # reused, not rebuilt

    tiny.build_tiny_model(a, 'llama', **kwargs)  # other arch in the same dir: rebuilt, with its own tokenizer
    assert json.loads((a / 'config.json').read_text())['model_type'] == 'llama'
    assert (a / 'tokenizer.json').stat().st_size == EXPECTED['llama']['size']


def test_build_tiny_model_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        tiny.build_tiny_model(tmp_path / 'x', 'gpt2')
    msg = str(err.value)
    assert 'arch' in msg and "'gpt2'" in msg and 'qwen2' in msg and 'llama' in msg
    assert not (tmp_path / 'x').exists()


def test_write_gsm8k_dataset(tmp_path: Path) -> None:
    full = _read_jsonl(tiny.write_gsm8k_dataset(tmp_path / 'full.jsonl'))
    assert len(full) == 500
    out = tiny.write_gsm8k_dataset(tmp_path / 'sub' / 'seven.jsonl', n=7)
    assert out == tmp_path / 'sub' / 'seven.jsonl'
    rows = _read_jsonl(out)
    assert rows == full[:7]
    first = rows[0]['messages']
    assert [m['role'] for m in first] == ['user', 'assistant']
    assert first[0]['content'].startswith('Natalia sold clips to 48 of her friends in April')
    assert first[1]['content'].endswith('#### 72')


@pytest.mark.parametrize('n', [0, -1, 501])
def test_write_gsm8k_dataset_rejects_bad_n(tmp_path: Path, n: int) -> None:
    with pytest.raises(ValueError, match=rf'\bn\b.*{n}'):
        tiny.write_gsm8k_dataset(tmp_path / 'bad.jsonl', n=n)
    assert not (tmp_path / 'bad.jsonl').exists()


def test_write_mixed_length_dataset(tmp_path: Path) -> None:
    path = tiny.write_mixed_length_dataset(tmp_path / 'mixed.jsonl')
    rows = _read_jsonl(path)
    assert len(rows) == 64
    assert all([m['role'] for m in r['messages']] == ['user', 'assistant'] for r in rows)
    answers = [r['messages'][1]['content'] for r in rows]
    assert {a.count('####') for a in answers} == set(range(1, 7))
    lengths = [len(a) for a in answers]
    assert max(lengths) > 4 * min(lengths)

    assert tiny.write_mixed_length_dataset(tmp_path / 'again.jsonl').read_bytes() == path.read_bytes()
    assert tiny.write_mixed_length_dataset(tmp_path / 'other.jsonl', seed=1).read_bytes() != path.read_bytes()
    assert len(_read_jsonl(tiny.write_mixed_length_dataset(tmp_path / 'three.jsonl', n=3))) == 3
    with pytest.raises(ValueError, match=r'\bn\b.*0'):
        tiny.write_mixed_length_dataset(tmp_path / 'bad.jsonl', n=0)


def test_prepare_demo_names_the_option_it_refuses(tmp_path: Path, capsys) -> None:
    from swift_dynamic_callbacks import cli
    assert cli.main(['prepare-demo', str(tmp_path / 'd'), '--rows', '600']) == 2
    assert "--rows: between 1 and 500 (the GSM8K train rows vendored), got 600" in capsys.readouterr().err
    assert cli.main(['prepare-demo', str(tmp_path / 'd'), '--rows', '4', '--eval-rows', '0']) == 2
    assert '--eval-rows: between 1 and 100 (the GSM8K held-out test rows vendored), got 0' in capsys.readouterr().err
    assert not (tmp_path / 'd').exists()  # nothing written
