"""Offline datasets for tests, benchmarks and the demo, written from the vendored GSM8K rows (``assets/gsm8k``, MIT;
500 train and 100 held-out test rows): chat rows, rows of several problems, raw text, preference pairs, prompts,
retrieval rows, and image / video rows with generated images. :mod:`.tiny` re-exports every writer.

Example:
    >>> data_file = write_gsm8k_dataset('train.jsonl', n=64)        # doctest: +SKIP
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

_GSM8K_DIR = Path(__file__).resolve().parent.parent / 'assets' / 'gsm8k'

GSM8K_ROWS: int = 500
"""Number of GSM8K rows vendored in ``assets/gsm8k/train-500.jsonl.gz``."""

GSM8K_TEST_ROWS: int = 100
"""Number of held-out GSM8K test rows vendored in ``assets/gsm8k/test-100.jsonl.gz``."""

_GSM8K_FILE = _GSM8K_DIR / 'train-500.jsonl.gz'
_GSM8K_TEST_FILE = _GSM8K_DIR / 'test-100.jsonl.gz'


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


#: image sizes (width, height) of :func:`write_image_dataset`'s rows, in pixels: 4 to 63 image tokens each
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((56, 56), (84, 112), (112, 84), (140, 140), (168, 112), (224, 224),
                                            (196, 140), (112, 224), (56, 168), (252, 196))


def _noisy_png(path: Path, width: int, height: int, rng: random.Random) -> Path:
    """Writes a ``width x height`` PNG of one random colour with 20 random pixels (drawn from ``rng``) to ``path``;
    returns its absolute path."""
    from PIL import Image
    image = Image.new('RGB', (width, height), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(20):
        image.putpixel((rng.randrange(width), rng.randrange(height)), tuple(rng.randrange(256) for _ in range(3)))
    path = path.resolve()
    image.save(path)
    return path


def _media_paths(dest_file: str | Path, folder: str | Path | None, kind: str) -> tuple[Path, Path]:
    """``dest_file`` as a path and the folder its media files go to (``folder``, else ``<stem>_<kind>`` beside it),
    created."""
    path = Path(dest_file)
    media = Path(folder) if folder is not None else path.with_name(f'{path.stem}_{kind}')
    media.mkdir(parents=True, exist_ok=True)
    return path, media


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
    if n < 1:
        raise ValueError(f'n must be >= 1, got n={n!r}')
    path, folder = _media_paths(dest_file, image_dir, 'images')
    rng, source = random.Random(seed), _gsm8k_rows()
    rows: list[dict[str, Any]] = []
    for i in range(n):
        problem = source[i % len(source)]
        if text_every and i % text_every == text_every - 1:
            rows.append(_messages(problem['question'], problem['answer'][:200]))
            continue
        width, height = sizes[i % len(sizes)]
        image_file = _noisy_png(folder / f'image{i}.png', width, height, rng)
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
    if n < 1:
        raise ValueError(f'n must be >= 1, got n={n!r}')
    if min(frames) < 1:
        raise ValueError(f'every video needs at least 1 frame, got frames={frames!r}')
    path, folder = _media_paths(dest_file, frame_dir, 'frames')
    rng, source = random.Random(seed), _gsm8k_rows()
    rows: list[dict[str, Any]] = []
    for i in range(n):
        problem = source[i % len(source)]
        width, height = sizes[i % len(sizes)]
        files = []
        for j in range(frames[i % len(frames)]):
            files.append(str(_noisy_png(folder / f'video{i}_frame{j}.png', width, height, rng)))
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
