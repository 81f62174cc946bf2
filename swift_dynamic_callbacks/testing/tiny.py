"""Offline fixtures: tiny random-weight causal LMs (Qwen2, LLaMA) with real tokenizers, and the ms-swift arguments of
an offline run of one; the import path of every fixture (the datasets of :mod:`.tiny_data` are re-exported here; the
vision-language models are :mod:`.tiny_vl`'s).

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
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PretrainedConfig,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM)

from .tiny_data import (GSM8K_ROWS, GSM8K_TEST_ROWS, IMAGE_SIZES, _atomic_write, write_gsm8k_dataset,
                        write_image_dataset, write_mixed_length_dataset, write_preference_dataset,
                        write_prompt_dataset, write_retrieval_dataset, write_text_dataset, write_video_dataset)

__all__ = [
    'ASSETS',
    'ARCHS',
    'GSM8K_ROWS',
    'GSM8K_TEST_ROWS',
    'IMAGE_SIZES',
    'MODEL_FLAGS',
    'build_tiny_model',
    'build_stopping_model',
    'materialize_tokenizer',
    'move_model_into_place',
    'offline_sft_kwargs',
    'write_gsm8k_dataset',
    'write_mixed_length_dataset',
    'write_image_dataset',
    'write_video_dataset',
    'write_prompt_dataset',
    'write_text_dataset',
    'write_preference_dataset',
    'write_retrieval_dataset',
]

ASSETS: Path = Path(__file__).resolve().parent.parent / 'assets'
"""Directory holding the vendored tokenizer and dataset files."""

ARCHS: tuple[str, ...] = ('qwen2', 'llama')
"""Architectures accepted by :func:`build_tiny_model`."""



_TOKENIZER_DIRS: dict[str, Path] = {'qwen2': ASSETS / 'qwen2.5-tokenizer', 'llama': ASSETS / 'smollm2-tokenizer'}
_QWEN2_VOCAB_SIZE = 151936  # real Qwen2.5 embedding rows (len(tokenizer) is 151665)
_NUM_HEADS = 4
_NUM_KV_HEADS = 2


def _gzip_size(path: Path) -> int:
    """Returns the uncompressed size stored in a gzip trailer (ISIZE, exact below 4 GiB)."""
    with path.open('rb') as f:
        f.seek(-4, os.SEEK_END)
        return struct.unpack('<I', f.read(4))[0]


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


#: ms-swift flags of each tiny architecture (a local model directory needs model_type and template).
MODEL_FLAGS: dict[str, dict[str, str]] = {
    'qwen2': {'model_type': 'qwen2', 'template': 'qwen2_5'},
    'llama': {'model_type': 'llama', 'template': 'chatml'},  # as the main job trains SmolLM2
    'qwen2_vl': {'model_type': 'qwen2_vl', 'template': 'qwen2_vl'},
    'qwen2_5_vl': {'model_type': 'qwen2_5_vl', 'template': 'qwen2_5_vl'},
    'qwen3_5': {'model_type': 'qwen3_5', 'template': 'qwen3_5'},
    'qwen3_5_moe': {'model_type': 'qwen3_5_moe', 'template': 'qwen3_5'},
    'qwen3_vl': {'model_type': 'qwen3_vl', 'template': 'qwen3_vl'},
    'internvl': {'model_type': 'internvl', 'template': 'internvl_hf'},
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
