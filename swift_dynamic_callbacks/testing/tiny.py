"""Offline fixtures: tiny random-weight causal LMs and small chat datasets.

Everything is built from package data under :data:`ASSETS` (the real Qwen2.5
tokenizer for the tiny Qwen2, the real SmolLM2 tokenizer for the tiny LLaMA, and
GSM8K rows), so tests and demos run without network access or a model hub.
Licences and provenance are in the ``NOTICE.md`` files next to the assets.

Example:
    >>> model_dir = build_tiny_model('tiny-qwen', 'qwen2')          # doctest: +SKIP
    >>> data_file = write_gsm8k_dataset('train.jsonl', n=64)        # doctest: +SKIP
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PretrainedConfig,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM)

__all__ = [
    'ASSETS',
    'ARCHS',
    'GSM8K_ROWS',
    'build_tiny_model',
    'build_stopping_model',
    'materialize_tokenizer',
    'write_gsm8k_dataset',
    'write_mixed_length_dataset',
    'build_tiny_vl_model',
    'write_image_dataset',
    'write_video_dataset',
    'write_prompt_dataset',
    'write_text_dataset',
    'write_preference_dataset',
    'write_retrieval_dataset',
    'VL_ARCHS',
    'QWEN3_ARCHS',
    'QWEN3_5_TOKEN_SHIFT',
    'build_tiny_qwen3_model',
    'materialize_qwen3_tokenizer',
]

ASSETS: Path = Path(__file__).resolve().parent.parent / 'assets'
"""Directory holding the vendored tokenizer and dataset files."""

ARCHS: tuple[str, ...] = ('qwen2', 'llama')
"""Architectures accepted by :func:`build_tiny_model`."""

GSM8K_ROWS: int = 500
"""Number of GSM8K rows vendored in ``assets/gsm8k/train-500.jsonl.gz``."""

GSM8K_TEST_ROWS: int = 100
"""Number of held-out GSM8K test rows vendored in ``assets/gsm8k/test-100.jsonl.gz``."""

_TOKENIZER_DIRS: dict[str, Path] = {'qwen2': ASSETS / 'qwen2.5-tokenizer', 'llama': ASSETS / 'smollm2-tokenizer'}
_GSM8K_FILE = ASSETS / 'gsm8k' / 'train-500.jsonl.gz'
_GSM8K_TEST_FILE = ASSETS / 'gsm8k' / 'test-100.jsonl.gz'
_QWEN2_VOCAB_SIZE = 151936  # real Qwen2.5 embedding rows (len(tokenizer) is 151665)
_NUM_HEADS = 4
_NUM_KV_HEADS = 2


def _gzip_size(path: Path) -> int:
    """Returns the uncompressed size stored in a gzip trailer (ISIZE, exact below 4 GiB)."""
    with path.open('rb') as f:
        f.seek(-4, os.SEEK_END)
        return struct.unpack('<I', f.read(4))[0]


def _atomic_write(target: Path, data: bytes) -> None:
    """Writes ``data`` to ``target`` through a temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f'.{target.name}.')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f'arch must be one of {list(ARCHS)}, got arch={arch!r}')


def materialize_tokenizer(dest: str | Path, arch: str = 'qwen2') -> Path:
    """Writes the tokenizer files of an architecture's tiny model into a directory.

    ``qwen2``: the Qwen2.5 tokenizer (151,665 tokens). ``llama``: the SmolLM2-135M-Instruct tokenizer (49,152 tokens,
    ChatML special tokens) -- the tokenizer of the main job's LLaMA-architecture model; its smaller vocabulary makes a
    tiny LLaMA step about 2.5 times cheaper than a tiny Qwen2 step (the output layer and the loss dominate).
    ``tokenizer.json`` is decompressed from the vendored gzip and ``tokenizer_config.json`` is copied. A file that
    already exists with the expected size is left untouched.

    Args:
        dest: Target directory; created if missing.
        arch: ``'qwen2'`` or ``'llama'``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`, loadable with ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: If ``arch`` is not one of :data:`ARCHS`.
    """
    _check_arch(arch)
    source = _TOKENIZER_DIRS[arch]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok_json = dest / 'tokenizer.json'
    src_json = source / 'tokenizer.json.gz'
    if not tok_json.is_file() or tok_json.stat().st_size != _gzip_size(src_json):
        with gzip.open(src_json, 'rb') as f:
            _atomic_write(tok_json, f.read())
    src_cfg = source / 'tokenizer_config.json'
    tok_cfg = dest / 'tokenizer_config.json'
    if not tok_cfg.is_file() or tok_cfg.stat().st_size != src_cfg.stat().st_size:
        _atomic_write(tok_cfg, src_cfg.read_bytes())
    return dest


def _existing_matches(config_file: Path, arch: str, hidden_size: int, num_layers: int) -> bool:
    """Tells whether a previously built model in ``config_file``'s directory can be reused."""
    if not config_file.is_file() or not (config_file.parent / 'model.safetensors').is_file():
        return False
    try:
        cfg: dict[str, Any] = json.loads(config_file.read_text(encoding='utf-8'))
    except (OSError, ValueError):
        return False
    tokenizer_file = config_file.parent / 'tokenizer.json'
    return (cfg.get('model_type') == arch and cfg.get('hidden_size') == hidden_size
            and cfg.get('num_hidden_layers') == num_layers and tokenizer_file.is_file()
            and tokenizer_file.stat().st_size == _gzip_size(_TOKENIZER_DIRS[arch] / 'tokenizer.json.gz'))


def build_tiny_model(
    dest: str | Path,
    arch: str = 'qwen2',
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
) -> Path:
    """Builds and saves a tiny random-weight causal LM with a real tokenizer.

    The model has 4 attention heads, 2 key/value heads, ``intermediate_size =
    4 * hidden_size``, 2048 positions, tied embeddings and float32 weights.
    ``qwen2`` has the real Qwen2.5 tokenizer and vocabulary size (151936; eos
    ``<|im_end|>`` = 151645, pad ``<|endoftext|>`` = 151643, no bos); ``llama``
    has the real SmolLM2 tokenizer and ``len(tokenizer)`` rounded up to a
    multiple of 64 (49152; bos ``<|im_start|>`` = 1, eos and pad ``<|im_end|>``
    = 2), a tiny SmolLM2. Weights depend only on ``seed`` and the shape
    arguments; the global torch RNG state is left as it was.

    The directory gets ``config.json`` (written last), ``model.safetensors``,
    ``generation_config.json`` and the tokenizer files. If ``dest/config.json``
    already describes the same arch, hidden size and layer count, nothing is rebuilt.

    Args:
        dest: Target directory; created if missing.
        arch: ``'qwen2'`` or ``'llama'``.
        seed: Seed for the weight initialisation.
        hidden_size: Model width; a multiple of 8 (4 heads with an even head dim).
        num_layers: Number of decoder layers, at least 1.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: If ``arch``, ``hidden_size`` or ``num_layers`` is not allowed.
    """
    _check_arch(arch)
    step = 2 * _NUM_HEADS  # 4 heads, even head_dim for rotary embeddings
    if hidden_size <= 0 or hidden_size % step != 0:
        raise ValueError(f'hidden_size must be a positive multiple of {step}, got hidden_size={hidden_size!r}')
    if num_layers < 1:
        raise ValueError(f'num_layers must be >= 1, got num_layers={num_layers!r}')
    dest = Path(dest)
    if _existing_matches(dest / 'config.json', arch, hidden_size, num_layers):
        return dest
    dest.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        materialize_tokenizer(tmp, arch)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        eos_id = tokenizer.convert_tokens_to_ids('<|im_end|>')
        pad_id = tokenizer.pad_token_id
        bos_id = tokenizer.bos_token_id
        common: dict[str, Any] = dict(
            hidden_size=hidden_size,
            intermediate_size=4 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=_NUM_HEADS,
            num_key_value_heads=_NUM_KV_HEADS,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            dtype='float32',
        )
        config: PretrainedConfig
        model_cls: type[PreTrainedModel]
        if arch == 'qwen2':
            config = Qwen2Config(vocab_size=_QWEN2_VOCAB_SIZE, **common)
            model_cls = Qwen2ForCausalLM
        else:
            config = LlamaConfig(vocab_size=-(-len(tokenizer) // 64) * 64, **common)
            model_cls = LlamaForCausalLM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(torch.float32).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id, eos_token_id=list(dict.fromkeys([eos_id, pad_id])), pad_token_id=pad_id,
            do_sample=False)
        model.save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest


def build_stopping_model(dest: str | Path, base: str | Path, *, eos_margin: float = 0.15) -> Path:
    """A copy of the tiny model in ``base`` whose sampled completions end by themselves about half the time within 16
    tokens (a random tiny model almost never samples its eos among 151,936 tokens, so every GRPO completion would be
    truncated). Embedding dimension 0 of every token is set to 1, which then dominates the normalised last hidden
    state and shifts every logit alike; the eos row gets ``1 + eos_margin`` there, lifting the eos logit alone
    (embeddings are tied). With the tiny Qwen2 (hidden 64) and ``eos_margin`` 0.15, about 45 % of 16-token sampled
    completions are truncated. Rebuilt only when ``dest`` lacks a model."""
    dest, base = Path(dest), Path(base)
    if (dest / 'config.json').is_file() and (dest / 'model.safetensors').is_file():
        return dest
    from transformers import AutoModelForCausalLM
    config = json.loads((base / 'config.json').read_text(encoding='utf-8'))
    eos = config['eos_token_id']
    eos = eos[0] if isinstance(eos, list) else eos
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight[:, 0] = 1.0
        weight[eos, 0] = 1.0 + eos_margin
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        model.save_pretrained(tmp)
        for item in base.iterdir():  # the tokenizer and generation files
            if item.is_file() and not (tmp / item.name).exists():
                shutil.copy2(item, tmp / item.name)
        move_model_into_place(tmp, dest)
    return dest


def move_model_into_place(built: Path, dest: Path) -> None:
    """Move every file of a model folder built in ``built`` into ``dest`` (same file system), ``config.json`` last:
    its presence marks a complete model, so an interrupted build is never taken for one."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / 'config.json').unlink(missing_ok=True)
    for item in sorted(built.iterdir(), key=lambda p: p.name == 'config.json'):
        target = dest / item.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        if item.is_file():
            os.chmod(item, 0o644)
        os.replace(item, target)


def _gsm8k_rows(split: str = 'train') -> list[dict[str, str]]:
    """Reads the vendored GSM8K rows (``question``/``answer``) of ``split`` (``train`` or ``test``)."""
    with gzip.open(_GSM8K_TEST_FILE if split == 'test' else _GSM8K_FILE, 'rt', encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_jsonl(dest_file: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Writes ``rows`` as UTF-8 JSON Lines, creating parent directories."""
    path = Path(dest_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ''.join(json.dumps(row, ensure_ascii=False) + '\n' for row in rows)
    _atomic_write(path, text.encode('utf-8'))
    return path


def _messages(user: str, assistant: str) -> dict[str, Any]:
    """Returns one single-turn row in ms-swift's ``messages`` format."""
    return {'messages': [{'role': 'user', 'content': user}, {'role': 'assistant', 'content': assistant}]}


def write_gsm8k_dataset(dest_file: str | Path, n: int | None = None, split: str = 'train', *,
                        calculator: bool = True) -> Path:
    """Writes GSM8K rows as a ``messages``-format JSONL file for ``swift sft --dataset``.

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of rows (the first ``n`` of the vendored ones: 500 train, 100 test); all if None.
        split: ``'train'`` (GSM8K train rows) or ``'test'`` (held-out GSM8K test rows, for evaluation).
        calculator: keep GSM8K's calculator annotations (``<<3*6=18>>``) in the answers; ``False`` drops them (the
            plain reasoning a small model can imitate; the main job's setting).

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: If ``split`` is unknown or ``n`` is outside 1..rows of the split.
    """
    if split not in ('train', 'test'):
        raise ValueError(f"split must be 'train' or 'test', got split={split!r}")
    limit = GSM8K_ROWS if split == 'train' else GSM8K_TEST_ROWS
    if n is not None and not 1 <= n <= limit:
        raise ValueError(f'n must be between 1 and {limit} for split={split!r} (or None for all), got n={n!r}')
    rows = _gsm8k_rows(split)[:n]
    answers = [r['answer'] if calculator else re.sub(r'<<[^>]*>>', '', r['answer']) for r in rows]
    return _write_jsonl(dest_file, [_messages(r['question'], a) for r, a in zip(rows, answers)])


def write_mixed_length_dataset(dest_file: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Writes a ``messages``-format JSONL file whose row lengths vary widely.

    Each row bundles ``k`` distinct GSM8K problems, with ``k`` cycling through
    1..6 in a seeded shuffled order (so any ``n >= 6`` covers every ``k``). The
    user turn lists the ``k`` questions and the assistant turn their ``k``
    answers, giving rows of roughly 100 to 1,300 Qwen2.5 tokens.

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of rows, at least 1.
        seed: Seed for the choice of ``k`` and of the problems.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: If ``n`` is less than 1.
    """
    if n < 1:
        raise ValueError(f'n must be >= 1, got n={n!r}')
    source = _gsm8k_rows()
    rng = random.Random(seed)
    ks = [i % 6 + 1 for i in range(n)]
    rng.shuffle(ks)
    rows: list[dict[str, Any]] = []
    for k in ks:
        picked = rng.sample(source, k)
        if k == 1:
            user, assistant = picked[0]['question'], picked[0]['answer']
        else:
            user = f'Solve these {k} problems.\n\n' + '\n\n'.join(
                f'Problem {i}: {r["question"]}' for i, r in enumerate(picked, 1))
            assistant = '\n\n'.join(f'Problem {i}:\n{r["answer"]}' for i, r in enumerate(picked, 1))
        rows.append(_messages(user, assistant))
    return _write_jsonl(dest_file, rows)


VL_ARCHS: tuple[str, ...] = ('qwen2_vl', 'qwen2_5_vl')
"""Vision-language architectures accepted by :func:`build_tiny_vl_model`."""


def _built(dest: Path, arch: str) -> bool:
    """Whether ``dest`` holds a complete model of ``model_type`` ``arch`` (``config.json``, written last, and its
    weights), to be reused."""
    config_file = dest / 'config.json'
    if not (config_file.is_file() and (dest / 'model.safetensors').is_file()):
        return False
    try:
        return json.loads(config_file.read_text(encoding='utf-8')).get('model_type') == arch
    except ValueError:
        return False


def build_tiny_vl_model(dest: str | Path, arch: str = 'qwen2_vl', *, seed: int = 0,
                        max_pixels: int = 224 * 224) -> Path:
    """Builds and saves a tiny random-weight Qwen2-VL or Qwen2.5-VL with the real Qwen2.5 tokenizer and a real
    processor (patch 14, merge 2, temporal patch 2; images resized within ``max_pixels``).

    The language model is the tiny Qwen2's shape (hidden 64, 2 layers, 4 heads, 2 key/value heads, the Qwen2.5
    vocabulary, 3-D rotary sections ``[2, 3, 3]``); the vision tower has 2 blocks (Qwen2-VL: width 32; Qwen2.5-VL: width
    32, windows of 112 pixels, the last block full attention) and merges 2 x 2 patches into one image token. Weights
    depend only on ``seed``; the global torch RNG state is left as it was. An existing complete model is reused.

    Args:
        dest: Target directory; created if missing.
        arch: ``'qwen2_vl'`` or ``'qwen2_5_vl'`` (:data:`VL_ARCHS`).
        seed: Seed for the weight initialisation.
        max_pixels: The image processor's ``max_pixels``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path` (``--model_type`` / ``--template``: :data:`MODEL_FLAGS`).

    Raises:
        ValueError: If ``arch`` is not one of :data:`VL_ARCHS`.
    """
    if arch not in VL_ARCHS:
        raise ValueError(f'arch must be one of {list(VL_ARCHS)}, got arch={arch!r}')
    dest = Path(dest)
    if _built(dest, arch):
        return dest
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        materialize_tokenizer(tmp, 'qwen2')
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        text = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=_NUM_HEADS,
                    num_key_value_heads=_NUM_KV_HEADS, vocab_size=_QWEN2_VOCAB_SIZE, max_position_embeddings=4096,
                    rope_parameters={'rope_type': 'default', 'mrope_section': [2, 3, 3], 'rope_theta': 1e6},
                    eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'), pad_token_id=tokenizer.pad_token_id,
                    dtype='float32')
        tokens = dict(image_token_id=tokenizer.convert_tokens_to_ids('<|image_pad|>'),
                      video_token_id=tokenizer.convert_tokens_to_ids('<|video_pad|>'),
                      vision_start_token_id=tokenizer.convert_tokens_to_ids('<|vision_start|>'),
                      vision_end_token_id=tokenizer.convert_tokens_to_ids('<|vision_end|>'), tie_word_embeddings=True)
        if arch == 'qwen2_vl':
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2)
            config, model_cls = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens), \
                Qwen2VLForConditionalGeneration
        else:
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          fullatt_block_indexes=[1])
            config, model_cls = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens), \
                Qwen2_5_VLForConditionalGeneration
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(torch.float32).eval()
        model.save_pretrained(tmp)
        pixels = dict(min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
        parts: dict[str, Any] = dict(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer)
        try:  # transformers 5 processors take a video processor too
            from transformers import Qwen2VLVideoProcessor
            parts['video_processor'] = Qwen2VLVideoProcessor(**pixels)
        except ImportError:  # pragma: no cover - older transformers
            pass
        Qwen2VLProcessor(**parts).save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest


QWEN3_ARCHS: tuple[str, ...] = ('qwen3_5', 'qwen3_5_moe', 'qwen3_vl')
"""Architectures accepted by :func:`build_tiny_qwen3_model` (Qwen3.5, Qwen3.5-MoE, Qwen3-VL)."""

QWEN3_5_TOKEN_SHIFT: int = 96401
"""How far Qwen3.5's added tokens sit above Qwen2.5's: ``<|endoftext|>`` 151643 -> 248044, ``<|image_pad|>`` 151655 ->
248056 (the ids ms-swift's ``Qwen3_5Template`` hard-codes)."""

#: the four added tokens Qwen3 appended to Qwen2.5's 22 (ids 151665-151668; Qwen3.5: 248066-248069)
_QWEN3_EXTRA_TOKENS: tuple[str, ...] = ('<tool_response>', '</tool_response>', '<think>', '</think>')
_QWEN3_5_VOCAB_SIZE = 248320  # real Qwen3.5 embedding rows
_QWEN3_TOKENIZER_FAMILIES: tuple[str, ...] = ('qwen3', 'qwen3_5')


def materialize_qwen3_tokenizer(dest: str | Path, family: str = 'qwen3_5') -> Path:
    """Writes a Qwen3 or Qwen3.5 tokenizer derived from the vendored Qwen2.5 one into a directory.

    Both keep Qwen2.5's byte-level BPE (151,643 tokens, its merges, "Hello world" -> ``[9707, 1879]``) and its 22 added
    tokens, and append Qwen3's four added tokens ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``
    (not special, as ``<tool_call>``). ``qwen3``: the added tokens at Qwen3's ids 151643-151668 (``<|image_pad|>`` =
    151655, the tokenizer of Qwen3 and Qwen3-VL). ``qwen3_5``: every added token moved up by
    :data:`QWEN3_5_TOKEN_SHIFT` to Qwen3.5's ids 248044-248069 (``<|endoftext|>`` = 248044 pad, ``<|im_start|>`` =
    248045, ``<|im_end|>`` = 248046 eos, ``<|vision_start|>`` / ``<|vision_end|>`` = 248053 / 248054,
    ``<|image_pad|>`` / ``<|video_pad|>`` = 248056 / 248057, ``<think>`` / ``</think>`` = 248068 / 248069). Qwen3.5's
    real BPE is larger (248,044 tokens); ids 151643-248043 stay unused here.

    ``tokenizers`` gives an added token that is not in the BPE vocabulary the next free id whatever id the file names,
    so the shifted tokens are also written into the BPE vocabulary at their ids (no merge produces them). Hence
    ``len(tokenizer)`` is 151,669 for both families, below the largest id + 1 for ``qwen3_5``: size embeddings by the
    ids, not by ``len``. ``tokenizer_config.json`` is the vendored Qwen2.5 one (its ChatML chat template included;
    ms-swift's own templates do not use it) with ``added_tokens_decoder`` rewritten. Files that already hold the
    expected content are left untouched.

    Args:
        dest: Target directory; created if missing.
        family: ``'qwen3'`` or ``'qwen3_5'``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`, loadable with ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: If ``family`` is not ``'qwen3'`` or ``'qwen3_5'``.
    """
    if family not in _QWEN3_TOKENIZER_FAMILIES:
        raise ValueError(f'family must be one of {list(_QWEN3_TOKENIZER_FAMILIES)}, got family={family!r}')
    shift = QWEN3_5_TOKEN_SHIFT if family == 'qwen3_5' else 0
    source = _TOKENIZER_DIRS['qwen2']
    with gzip.open(source / 'tokenizer.json.gz', 'rt', encoding='utf-8') as f:
        tokenizer_json: dict[str, Any] = json.load(f)
    added: list[dict[str, Any]] = tokenizer_json['added_tokens']
    template = next(token for token in added if token['content'] == '<tool_call>')
    for content in _QWEN3_EXTRA_TOKENS:
        added.append({**template, 'id': added[-1]['id'] + 1, 'content': content})
    if shift:
        vocab: dict[str, int] = tokenizer_json['model']['vocab']
        for token in added:
            token['id'] += shift
            vocab[token['content']] = token['id']
    config: dict[str, Any] = json.loads((source / 'tokenizer_config.json').read_text(encoding='utf-8'))
    fields = ('content', 'lstrip', 'normalized', 'rstrip', 'single_word', 'special')
    config['added_tokens_decoder'] = {str(token['id']): {k: token[k] for k in fields} for token in added}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in (('tokenizer.json', json.dumps(tokenizer_json, ensure_ascii=False)),
                          ('tokenizer_config.json', json.dumps(config, ensure_ascii=False, indent=2) + '\n')):
        data, target = content.encode('utf-8'), dest / name
        if not target.is_file() or target.stat().st_size != len(data) or target.read_bytes() != data:
            _atomic_write(target, data)
    return dest


def build_tiny_qwen3_model(dest: str | Path, arch: str = 'qwen3_5', *, seed: int = 0,
                           max_pixels: int = 224 * 224) -> Path:
    """Builds and saves a tiny random-weight Qwen3.5, Qwen3.5-MoE or Qwen3-VL (``*ForConditionalGeneration``: a
    language model with a vision tower) with a real processor (image processor, video processor and tokenizer).

    Language model: hidden 64, 2 decoder layers, 4 attention heads and 2 key/value heads, tied embeddings, 3-D
    interleaved rotary positions.

    - ``qwen3_5`` (``Qwen3_5ForConditionalGeneration``): ``layer_types`` ``[linear_attention, full_attention]`` -- the
      first layer a Gated DeltaNet (linear attention: 2 key heads and 4 value heads of 16, causal convolution of
      width 4), the second gated full attention (head dim 32, rotary on a quarter of it, sections ``[2, 1, 1]``);
      MLP width 256; the Qwen3.5 vocabulary size 248320 with the Qwen3.5 token ids of
      :func:`materialize_qwen3_tokenizer` (``<|image_pad|>`` = 248056, the id ms-swift's ``Qwen3_5Template``
      hard-codes).
    - ``qwen3_5_moe`` (``Qwen3_5MoeForConditionalGeneration``): the same, with a sparse MLP in each layer: 4 experts of
      width 32, top-2 routing, and a gated shared expert of width 32. ``router_aux_loss_coef`` is left at the config's
      default (0.001) and ``output_router_logits`` at False; ms-swift overwrites the coefficient with its
      ``--router_aux_loss_coef`` (default 0: no auxiliary loss, the loss is the language-model loss alone).
    - ``qwen3_vl`` (``Qwen3VLForConditionalGeneration``): full attention in both layers (head dim 16, sections
      ``[4, 2, 2]``), MLP width 256, the Qwen3 tokenizer and vocabulary size 151936 (``<|image_pad|>`` = 151655);
      deepstack: the features after vision blocks 0 and 1 are merged and added to the hidden states of decoder layers
      0 and 1 at the image tokens.

    Vision tower (all three): 2 blocks of width 32 (2 heads, MLP 64), patch 16, 2 x 2 patches merged into one
    64-wide token (so a 32 x 32 pixel area is one image token), temporal patch 2, learned position embeddings
    interpolated over a 48 x 48 grid. The image processor resizes within ``max_pixels``, the video processor keeps
    Qwen3-VL's default frame budget; ms-swift's templates resize images and frames themselves (``qwen_vl_utils``,
    patch 16) and call them with ``do_resize=False``. Image and video processors normalise with mean and std 0.5.

    Weights are float32 and depend only on ``seed``; the global torch RNG state is left as it was. The Gated DeltaNet
    runs transformers' torch fallbacks (``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``) where
    ``flash-linear-attention`` / ``causal-conv1d`` are not installed. An existing complete model of ``arch`` is reused.

    Args:
        dest: Target directory; created if missing.
        arch: ``'qwen3_5'``, ``'qwen3_5_moe'`` or ``'qwen3_vl'`` (:data:`QWEN3_ARCHS`).
        seed: Seed for the weight initialisation.
        max_pixels: The image processor's ``max_pixels``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path` (``--model_type`` / ``--template``: :data:`MODEL_FLAGS`).

    Raises:
        ValueError: If ``arch`` is not one of :data:`QWEN3_ARCHS`.
    """
    if arch not in QWEN3_ARCHS:
        raise ValueError(f'arch must be one of {list(QWEN3_ARCHS)}, got arch={arch!r}')
    dest = Path(dest)
    if _built(dest, arch):
        return dest
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        family = 'qwen3' if arch == 'qwen3_vl' else 'qwen3_5'
        materialize_qwen3_tokenizer(tmp, family)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
            ('image_token_id', '<|image_pad|>'), ('video_token_id', '<|video_pad|>'),
            ('vision_start_token_id', '<|vision_start|>'), ('vision_end_token_id', '<|vision_end|>'))}
        eos_id, pad_id = tokenizer.convert_tokens_to_ids('<|im_end|>'), tokenizer.pad_token_id
        text: dict[str, Any] = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=_NUM_HEADS, num_key_value_heads=_NUM_KV_HEADS,
                                    max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos_id,
                                    pad_token_id=pad_id, dtype='float32')
        vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
        if arch == 'qwen3_vl':
            text.update(vocab_size=_QWEN2_VOCAB_SIZE, head_dim=16,
                        rope_parameters={'rope_type': 'default', 'rope_theta': 5e6, 'mrope_section': [4, 2, 2],
                                         'mrope_interleaved': True})
            vision.update(deepstack_visual_indexes=[0, 1])
            config_cls, model_cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        else:
            text.update(vocab_size=_QWEN3_5_VOCAB_SIZE, head_dim=32,
                        layer_types=['linear_attention', 'full_attention'],
                        rope_parameters={'rope_type': 'default', 'rope_theta': 1e7, 'partial_rotary_factor': 0.25,
                                         'mrope_section': [2, 1, 1], 'mrope_interleaved': True},
                        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4)
            if arch == 'qwen3_5_moe':
                del text['intermediate_size']
                text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32)
                config_cls, model_cls = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
            else:
                config_cls, model_cls = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
        config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(torch.float32).eval()
        model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                                                   do_sample=False)
        model.save_pretrained(tmp)
        patches = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=max_pixels, **patches),
                         video_processor=Qwen3VLVideoProcessor(**patches), tokenizer=tokenizer).save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest


#: image sizes (width, height) of :func:`write_image_dataset`'s rows, in pixels: 4 to 63 image tokens each
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((56, 56), (84, 112), (112, 84), (140, 140), (168, 112), (224, 224),
                                            (196, 140), (112, 224), (56, 168), (252, 196))


def write_image_dataset(dest_file: str | Path, n: int = 28, *, text_every: int = 7, sizes: Any = IMAGE_SIZES,
                        seed: int = 0, image_dir: str | Path | None = None) -> Path:
    """Writes an image + text ``messages`` JSONL file for a vision-language ``swift sft``, with its PNG images.

    Row ``i`` asks a GSM8K question about an image of ``sizes[i % len(sizes)]`` pixels (a random colour with a few
    random pixels) and answers with the problem's answer; every ``text_every``-th row has no image (``0``: none
    without). Images go to ``image_dir`` (default: ``<dest_file stem>_images`` beside it), referenced by absolute
    path.

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of rows, at least 1.
        text_every: Every this many rows, one has no image (0: every row has one).
        sizes: (width, height) of the images, cycled.
        seed: Seed of the images' colours.
        image_dir: Where the PNG files go.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.
    """
    from PIL import Image
    if n < 1:
        raise ValueError(f'n must be >= 1, got n={n!r}')
    path = Path(dest_file)
    folder = Path(image_dir) if image_dir is not None else path.with_name(f'{path.stem}_images')
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    source = _gsm8k_rows()
    rows: list[dict[str, Any]] = []
    for i in range(n):
        problem = source[i % len(source)]
        if text_every and i % text_every == text_every - 1:
            rows.append(_messages(problem['question'], problem['answer'][:200]))
            continue
        width, height = sizes[i % len(sizes)]
        image = Image.new('RGB', (width, height), tuple(rng.randrange(256) for _ in range(3)))
        for _ in range(20):
            image.putpixel((rng.randrange(width), rng.randrange(height)), tuple(rng.randrange(256) for _ in range(3)))
        image_file = (folder / f'image{i}.png').resolve()
        image.save(image_file)
        row = _messages('<image>' + problem['question'][:120], problem['answer'][:160])
        row['images'] = [str(image_file)]
        rows.append(row)
    return _write_jsonl(path, rows)


def write_video_dataset(dest_file: str | Path, n: int = 16, *, frames: Any = (2, 8), sizes: Any = IMAGE_SIZES,
                        seed: int = 0, frame_dir: str | Path | None = None) -> Path:
    """Writes a video + text ``messages`` JSONL file for a vision-language ``swift sft``, each video a list of PNG
    frames (ms-swift's ``videos`` entry as a list of image files).

    Row ``i`` asks a GSM8K question about a video of ``frames[i % len(frames)]`` frames of ``sizes[i % len(sizes)]``
    pixels (each frame a random colour with a few random pixels) and answers with the problem's answer. Frames go to
    ``frame_dir`` (default: ``<dest_file stem>_frames`` beside it), referenced by absolute path.

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of rows, at least 1.
        frames: frames of each row's video (at least 1 each), cycled.
        sizes: (width, height) of each row's frames, cycled.
        seed: Seed of the frames' colours.
        frame_dir: Where the PNG files go.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``n`` below 1 or a video of fewer than 1 frame.
    """
    from PIL import Image
    if n < 1:
        raise ValueError(f'n must be >= 1, got n={n!r}')
    if min(frames) < 1:
        raise ValueError(f'every video needs at least 1 frame, got frames={frames!r}')
    path = Path(dest_file)
    folder = Path(frame_dir) if frame_dir is not None else path.with_name(f'{path.stem}_frames')
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    source = _gsm8k_rows()
    rows: list[dict[str, Any]] = []
    for i in range(n):
        problem = source[i % len(source)]
        width, height = sizes[i % len(sizes)]
        files = []
        for j in range(frames[i % len(frames)]):
            frame = Image.new('RGB', (width, height), tuple(rng.randrange(256) for _ in range(3)))
            for _ in range(20):
                frame.putpixel((rng.randrange(width), rng.randrange(height)),
                               tuple(rng.randrange(256) for _ in range(3)))
            frame_file = (folder / f'video{i}_frame{j}.png').resolve()
            frame.save(frame_file)
            files.append(str(frame_file))
        row = _messages('<video>' + problem['question'][:120], problem['answer'][:160])
        row['videos'] = [files]
        rows.append(row)
    return _write_jsonl(path, rows)


def _train_rows(n: int) -> list[dict[str, str]]:
    """The first ``n`` vendored GSM8K train rows (``question`` / ``answer``), 1 to :data:`GSM8K_ROWS`."""
    if not 1 <= n <= GSM8K_ROWS:
        raise ValueError(f'n must be between 1 and {GSM8K_ROWS}, got n={n!r}')
    return _gsm8k_rows()[:n]


def write_text_dataset(dest_file: str | Path, n: int = 64) -> Path:
    """Writes GSM8K problems as raw text rows (``{"text": ...}``: ms-swift's form for ``swift pt``, continued
    pretraining: question and answer in one text, no chat template).

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of rows (the first ``n`` vendored train rows), 1 to 500.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.
    """
    return _write_jsonl(dest_file, [{'text': f'{r["question"]}\n{r["answer"]}'} for r in _train_rows(n)])


def write_preference_dataset(dest_file: str | Path, n: int = 64) -> Path:
    """Writes GSM8K problems as preference pairs for ``swift rlhf --rlhf_type dpo`` (ORPO, SimPO, CPO): the
    ``messages`` with the real answer chosen, and as ``rejected_response`` the answer cut before its final line.

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of pairs (the first ``n`` vendored train rows), 1 to 500.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.
    """
    rows = []
    for r in _train_rows(n):
        row = _messages(r['question'], r['answer'])
        row['rejected_response'] = r['answer'].rsplit('\n', 1)[0] or 'I do not know.'
        rows.append(row)
    return _write_jsonl(dest_file, rows)


def write_retrieval_dataset(dest_file: str | Path, n: int = 32, *, negatives: int = 2) -> Path:
    """Writes GSM8K problems as retrieval rows for ``task_type: embedding`` (InfoNCE) and ``reranker``: the question as
    ``messages``, its own answer as the one ``positive_messages`` entry and the answers of the next ``negatives``
    problems as ``negative_messages`` (ms-swift's MTEB reranking form).

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of rows (the first ``n`` vendored train rows), 1 to 500.
        negatives: Negative documents a row, at least 0.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.
    """
    if negatives < 0:
        raise ValueError(f'negatives must be >= 0, got negatives={negatives!r}')
    source = _train_rows(n)
    pool = _gsm8k_rows()

    def document(text: str) -> list[dict[str, str]]:
        return [{'role': 'assistant', 'content': text[:200]}]

    rows = [{'messages': [{'role': 'user', 'content': r['question']}],
             'positive_messages': [document(r['answer'])],
             'negative_messages': [document(pool[(i + k + 1) % len(pool)]['answer']) for k in range(negatives)]}
            for i, r in enumerate(source)]
    return _write_jsonl(dest_file, rows)


def write_prompt_dataset(dest_file: str | Path, n: int = 8) -> Path:
    """Writes GSM8K questions as prompts for ``swift rlhf --rlhf_type grpo`` (a ``messages`` list with the user turn
    only, and the final number as ``solution``, which ms-swift hands the reward functions).

    Args:
        dest_file: Output ``.jsonl`` path; parent directories are created.
        n: Number of prompts (the first ``n`` vendored train rows), 1 to 500.

    Returns:
        ``dest_file`` as a :class:`~pathlib.Path`.
    """
    rows = [{'messages': [{'role': 'user', 'content': r['question']}],
             'solution': r['answer'].split('####')[-1].strip()} for r in _train_rows(n)]
    return _write_jsonl(dest_file, rows)


#: ms-swift flags of each tiny architecture (a local model directory needs model_type and template).
MODEL_FLAGS: dict[str, dict[str, str]] = {
    'qwen2': {'model_type': 'qwen2', 'template': 'qwen2_5'},
    'llama': {'model_type': 'llama', 'template': 'chatml'},  # as the main job trains SmolLM2
    'qwen2_vl': {'model_type': 'qwen2_vl', 'template': 'qwen2_vl'},
    'qwen2_5_vl': {'model_type': 'qwen2_5_vl', 'template': 'qwen2_5_vl'},
    'qwen3_5': {'model_type': 'qwen3_5', 'template': 'qwen3_5'},
    'qwen3_5_moe': {'model_type': 'qwen3_5_moe', 'template': 'qwen3_5'},
    'qwen3_vl': {'model_type': 'qwen3_vl', 'template': 'qwen3_vl'},
}


def offline_sft_kwargs(model: str | Path, dataset: str | Path, output_dir: str | Path, *, arch: str = 'qwen2',
                       **overrides: Any) -> dict[str, Any]:
    """``SftArguments`` keyword arguments for an offline LoRA run of a tiny model (tests, benchmarks).

    No hub access (``check_model=False``), no reporting, one dataset process, no data split, workers 0,
    ``max_length`` 1024 (ms-swift deletes longer rows by default); ``overrides`` replace any of them.
    """
    if arch not in MODEL_FLAGS:
        raise ValueError(f'arch: must be one of {", ".join(MODEL_FLAGS)}, got {arch!r}')
    kwargs: dict[str, Any] = dict(
        model=str(model),
        tuner_type='lora',
        torch_dtype='float32',
        dataset=[str(dataset)],
        max_steps=8,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1000,
        check_model=False,
        report_to=['none'],
        add_version=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        dataset_num_proc=1,
        split_dataset_ratio=0.0,
        max_length=1024,
        output_dir=str(output_dir),
    )
    kwargs.update(MODEL_FLAGS[arch])
    kwargs.update(overrides)
    return kwargs
