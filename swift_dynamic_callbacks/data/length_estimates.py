"""Cheap length estimates for lazily tokenised datasets (``lazy_tokenize: true``): no row encoded before step 1.

Length-aware batching needs every sample's length before an epoch is planned. An encoded dataset has them (ms-swift's
``lengths`` column); a lazy one (ms-swift's ``LazyLLMDataset``: raw rows, encoded when read) would have to encode
every row first (about 0.8 ms a row: 13 minutes at 1M rows). Instead:

1. the characters of every raw row's text are counted with Arrow compute (the ``messages`` — ms-swift keeps them as
   JSON text —, string columns such as ``query`` / ``response`` / ``rejected_response``): about a second per
   million rows; a vision-language run's images and videos are counted exactly, from each image file's header (a
   video given as a list of image files: each frame's; a video file: its container's header) and the run's resize
   rules (:mod:`..policies.vision`), and the line below is fitted to the text alone;
2. ``sample`` evenly spaced rows are encoded for real; a line ``tokens = a + b * characters`` is fitted to their
   costs (:func:`~.rows.row_cost`: both rows of a DPO pair) and scaled up so no sampled row is under-estimated;
3. the estimates are written to a cache file beside the dataset's Arrow files (else in ``output_dir``), keyed by the
   dataset's fingerprint, its size, the sampled costs and what else changes a row's length (``key``: the template,
   ``max_length``, the truncation strategy, the mode): the main process computes them and replaces the file
   atomically, the other ranks read it after a barrier; several runs sharing the folder never read a half-written
   file;
4. the loader replaces an estimate by the real cost whenever a row is encoded (``ElasticDataLoader`` refines its
   table), and a micro-batch whose real padded tokens exceed the budget is run as several passes, each within the
   budget (same gradient), with an ``over_estimate`` record.

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Callable, Sequence

import numpy as np

from ..policies.vision import Video

CACHE_PREFIX = 'sdc_lengths-'
#: part of the cache key: a file written by another version of the estimate is not read
ESTIMATE_VERSION = 4


def is_lazy(dataset: Any) -> bool:
    """A dataset whose rows are encoded when read, over a raw ``datasets.Dataset`` (ms-swift's ``LazyLLMDataset``)."""
    raw = getattr(dataset, 'dataset', None)
    columns = getattr(raw, 'column_names', None) or ()
    return (callable(getattr(dataset, 'encode_func', None)) and raw is not None and 'lengths' not in columns
            and 'length' not in columns and hasattr(raw, 'data'))


def _text_chars(array: Any) -> np.ndarray | None:
    """Characters of text in every row of an Arrow array (strings, lists of strings / structs of strings)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if isinstance(array.type, pa.BaseExtensionType):  # e.g. ms-swift's ``Json`` messages: the JSON text
        array = array.storage
    kind = array.type
    n = len(array)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pc.fill_null(pc.utf8_length(array), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_struct(kind):
        total = np.zeros(n, dtype=np.int64)
        found = False
        for i in range(kind.num_fields):
            part = _text_chars(pc.struct_field(array, [i]))
            if part is not None:
                total += part
                found = True
        return total if found else None
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = _text_chars(pc.list_flatten(array))
        if inner is None:
            return None
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=inner, minlength=n).astype(np.int64)
    return None


#: columns of media files (paths, bytes): never counted as text
MEDIA_COLUMNS = ('images', 'videos', 'audios')


def _table_and_rows(raw: Any) -> tuple[Any, np.ndarray | None]:
    """The Arrow table of a ``datasets.Dataset`` and, for a selected / shuffled view, which of its rows the view's
    rows are (``None``: all, in order)."""
    table = raw.data.table if hasattr(raw.data, 'table') else raw.data
    indices = getattr(raw, '_indices', None)
    return table, (indices.column(0).to_numpy() if indices is not None else None)


def char_counts(raw: Any) -> np.ndarray:
    """Characters of text of every row of a ``datasets.Dataset`` (all text columns but the media files'), via Arrow
    compute.

    Raises:
        ValueError: no text column.
    """
    table, rows = _table_and_rows(raw)
    total, found = np.zeros(table.num_rows, dtype=np.int64), False
    for name in table.column_names:
        if name in MEDIA_COLUMNS:
            continue
        chars = _text_chars(table.column(name))
        if chars is not None:
            total += chars
            found = True
    if not found:
        raise ValueError(f'no text column to estimate lengths from (columns: {", ".join(table.column_names)})')
    return total[rows] if rows is not None else total


def image_headers(raw: Any) -> list[list[tuple[int, int]]]:
    """``(width, height)`` of every image of every row of a ``datasets.Dataset`` (its ``images`` column: paths, or
    ms-swift's ``{bytes, path}`` entries), read from each file's header (PIL opens lazily: no pixel is decoded).
    Rows without images (or without the column) have none.

    Raises:
        ValueError: an image that cannot be opened (its path named).
    """
    import io

    from PIL import Image
    table, rows = _table_and_rows(raw)
    if 'images' not in table.column_names:
        return [[] for _ in range(len(rows) if rows is not None else table.num_rows)]
    column = table.column('images').to_pylist()
    out = []
    for i in (rows if rows is not None else range(len(column))):
        sizes = []
        for entry in column[int(i)] or ():
            source = entry if isinstance(entry, str) else (entry or {}).get('path')
            data = None if isinstance(entry, str) else (entry or {}).get('bytes')
            try:
                with Image.open(io.BytesIO(data) if data else source) as image:
                    sizes.append(tuple(image.size))
            except (OSError, ValueError, TypeError) as e:
                raise ValueError(f'row {int(i)}: cannot read the size of image {source!r} ({e})') from e
        out.append(sizes)
    return out


def _local_path(source: Any) -> str | None:
    """A local file's path (``file://`` stripped), ``None`` for a URL or anything else."""
    if not isinstance(source, str) or source.startswith(('http://', 'https://', 'data:')):
        return None
    return source[7:] if source.startswith('file://') else source


def _video_file(path: str) -> Video | None:
    """A video file's frames, frame rate and frame size from its container's header (PyAV: nothing decoded), or
    ``None`` when PyAV is not installed or the header does not give them.

    The frames are the container's count (``nb_frames``; else duration x average rate). qwen-vl-utils' decoders count
    them their own way (torchcodec and decord from the same header or index; torchvision by decoding every frame),
    so a file whose header is wrong is counted as its header says."""
    try:
        import av
    except ImportError:
        return None
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            frames = int(stream.frames or 0)
            if not frames and stream.duration and stream.time_base and fps:
                frames = round(float(stream.duration * stream.time_base) * fps)
            width, height = stream.codec_context.width, stream.codec_context.height
    except (OSError, ValueError, IndexError, av.error.FFmpegError):
        return None
    if frames <= 0 or fps <= 0 or not width or not height:
        return None
    return Video(frames=frames, width=int(width), height=int(height), fps=fps)


def video_headers(raw: Any) -> tuple[list[list[Video]], int]:
    """Every video of every row of a ``datasets.Dataset`` (its ``videos`` column), from headers only, and how many
    videos could not be read that way.

    A video given as a list of image files (ms-swift's frames) is read from each frame's header (PIL: no pixel
    decoded; the largest frame is kept: qwen-vl-utils stacks the frames, so they are one size). A video file is read
    from its container's header (:func:`_video_file`, PyAV). A URL, a file whose header does not give its frames and
    rate, or PyAV missing: the video is not counted (the second value; its tokens stay in the text line's fit when it
    is a sampled row's).

    Raises:
        ValueError: a frame image that cannot be opened (its path named), as for images.
    """
    from PIL import Image
    table, rows = _table_and_rows(raw)
    if 'videos' not in table.column_names:
        return [[] for _ in range(len(rows) if rows is not None else table.num_rows)], 0
    column = table.column('videos').to_pylist()
    out, missed = [], 0
    for i in (rows if rows is not None else range(len(column))):
        videos = []
        for entry in column[int(i)] or ():
            if isinstance(entry, (list, tuple)) and entry:
                sizes = []
                for frame in entry:
                    path = _local_path(frame)
                    if path is None:
                        break
                    try:
                        with Image.open(path) as image:
                            sizes.append(tuple(image.size))
                    except (OSError, ValueError) as e:
                        raise ValueError(f'row {int(i)}: cannot read the size of video frame {frame!r} ({e})') from e
                if len(sizes) == len(entry):
                    width, height = max(sizes, key=lambda s: s[0] * s[1])
                    videos.append(Video(frames=len(sizes), width=width, height=height))
                    continue
            elif _local_path(entry) is not None:
                video = _video_file(_local_path(entry))
                if video is not None:
                    videos.append(video)
                    continue
            missed += 1
        out.append(videos)
    return out, missed


def fit(chars: Sequence[int], costs: Sequence[int]) -> tuple[float, float, float]:
    """``(a, b, scale)``: ``cost ~ scale * (a + b * chars)``, least squares on the sample, then scaled so that no
    sampled row is under-estimated (``scale >= 1``). ``b`` is positive; estimates are at least 1."""
    x, y = np.asarray(chars, dtype=float), np.asarray(costs, dtype=float)
    if len(x) >= 2 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
    else:
        a, b = 0.0, (float(y.mean() / max(x.mean(), 1.0)) if len(x) else 1.0)
    a, b = float(a), max(float(b), 1e-6)
    predicted = a + b * x
    scale = float(max(1.0, np.max(y / np.maximum(predicted, 1.0)))) if len(x) else 1.0
    return a, b, scale


def apply(chars: np.ndarray, a: float, b: float, scale: float) -> np.ndarray:
    return np.ceil(scale * (a + b * chars.astype(float))).astype(np.int64).clip(min=1)


def cache_dir(raw: Any, fallback: str | None) -> str | None:
    """Beside the dataset's Arrow files when that folder is writable, else ``fallback``."""
    for entry in getattr(raw, 'cache_files', None) or ():
        folder = os.path.dirname(entry.get('filename', ''))
        if folder and os.access(folder, os.W_OK):
            return folder
    return fallback


def estimate_lengths(dataset: Any, measure: Callable[[Any, int], int], *, sample: int = 64,
                     cache: str | None = None, is_main: bool = True, wait: Callable[[], None] = lambda: None,
                     key: Sequence[Any] = (), image_tokens: Callable[[int, int], int] | None = None,
                     video_tokens: Callable[[Video], int] | None = None) -> tuple[list[int], dict[str, Any]]:
    """Estimated cost of every sample of a lazy ``dataset`` and what the estimate is based on.

    Args:
        dataset: the lazy dataset (``dataset.dataset``: the raw rows; ``dataset[i]``: row ``i`` encoded).
        measure: ``(encoded item, index) -> cost`` (:func:`~.rows.row_cost` of its rows' lengths).
        sample: rows encoded for real to fit the estimate.
        cache: folder of the cache file (``None``: no cache).
        is_main: this process writes the cache; the others read it after ``wait`` (a barrier).
        key: what else changes a row's length (template, ``max_length``, truncation, the image resize, ...): part of
            the cache key, so a length cached under other settings is never read.
        image_tokens: ``(width, height) -> tokens`` an image becomes (the run's resize rule,
            :func:`~..policies.vision.image_tokens`): every row's images are counted exactly from their headers
            (:func:`image_headers`) and the line is fitted to the text alone (the sampled costs less their images'
            tokens), so a row's estimate follows its own images, not the sample's. ``None``: images not counted.
        video_tokens: ``video -> tokens`` a video becomes (the run's video rule,
            :func:`~..policies.vision.video_tokens`): every row's videos are counted from their headers
            (:func:`video_headers`) like the images. ``None``: videos not counted.

    Returns:
        ``(lengths, info)``; ``info``: ``rows``, ``sampled``, ``a``, ``b``, ``scale``, ``cache`` (file or ``None``),
        ``cached`` (read from the file), ``image_tokens`` (the images' tokens over all rows, when counted),
        ``video_tokens`` and ``videos_uncounted`` (the videos' tokens over all rows, and the videos whose headers did
        not give them or whose frames qwen-vl-utils refuses to sample, when videos are counted), and ``row_media``
        (each row's image and video tokens, when counted: cached beside the lengths; not for a record).
    """
    raw = dataset.dataset
    n = len(dataset)
    k = min(sample, n)
    picked = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)}) if n else []
    costs = [int(measure(dataset[i], i)) for i in picked]
    digest = hashlib.sha256(repr((ESTIMATE_VERSION, getattr(raw, '_fingerprint', None), n, picked, costs,
                                  tuple(key), image_tokens is not None, video_tokens is not None)
                                 ).encode()).hexdigest()[:20]
    path = os.path.join(cache, f'{CACHE_PREFIX}{digest}.npy') if cache else None
    info: dict[str, Any] = {'rows': n, 'sampled': len(picked), 'cache': path, 'cached': False}
    if not is_main:  # the main process writes the cache first
        wait()
    counts_media = image_tokens is not None or video_tokens is not None
    media_path = None if path is None else path[:-len('.npy')] + '.media.npy'
    if path is not None and os.path.exists(path) and (not counts_media or os.path.exists(media_path)):
        stored = np.load(path)
        media_stored = np.load(media_path) if counts_media else None
        if len(stored) == n and (media_stored is None or len(media_stored) == n):
            info['cached'] = True
            lengths = stored.tolist()
            for i, cost in zip(picked, costs):
                lengths[i] = cost
            if media_stored is not None:
                info['row_media'] = media_stored.tolist()
            if is_main:
                wait()
            return lengths, info
    chars = char_counts(raw)
    if len(chars) != n:
        raise ValueError(f'{len(chars)} raw rows for a dataset of {n}')
    media = np.zeros(n, dtype=np.int64)
    if image_tokens is not None:
        media = np.array([sum(image_tokens(w, h) for w, h in sizes) for sizes in image_headers(raw)], dtype=np.int64)
        info['image_tokens'] = int(media.sum())
    if video_tokens is not None:
        videos, missed = video_headers(raw)
        counted = np.zeros(n, dtype=np.int64)
        for row, row_videos in enumerate(videos):
            for video in row_videos:
                try:
                    counted[row] += video_tokens(video)
                except ValueError:  # frames qwen-vl-utils refuses to sample: ms-swift skips the row when read
                    missed += 1
        media += counted
        info.update(video_tokens=int(counted.sum()), videos_uncounted=missed)
    text = np.maximum(np.asarray(costs, dtype=np.int64) - media[picked], 1)
    a, b, scale = fit(chars[picked], text)
    estimates = apply(chars, a, b, scale) + media
    estimates[picked] = costs
    info.update(a=round(a, 4), b=round(b, 6), scale=round(scale, 4))
    if counts_media:
        info['row_media'] = media.tolist()
    if path is not None and is_main:
        os.makedirs(cache, exist_ok=True)
        for target, values in ((media_path, media if counts_media else None), (path, estimates)):  # lengths last
            if values is not None:
                tmp = f'{target}.{os.getpid()}.tmp.npy'
                np.save(tmp, values)
                os.replace(tmp, target)
    if is_main:
        wait()
    return estimates.tolist(), info


def mean_ratio(info: dict[str, Any]) -> float:
    """Tokens per 1,000 characters of the fitted line (for the decision record)."""
    return round(1000 * info.get('b', math.nan) * info.get('scale', 1.0), 3)
