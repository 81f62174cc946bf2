"""What a dataset's samples cost: the lengths of each sample's rows, its padded cost in a micro-batch, its real tokens,
and the fingerprint of a training dataset (compared at resume). No torch.

A sample is one row (``swift sft``) or several rows the collator makes from it (``swift rlhf``: DPO's chosen and
rejected rows, KTO's completion and KL row); the batch plans count every row.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

_LENGTHS_ATTR = '_sdc_lengths'
_REAL_ATTR = '_sdc_real_tokens'
#: prefixes of the rows ``swift rlhf`` encodes per sample (DPO/ORPO/SimPO/CPO/RM: chosen + rejected, run as two
#: padded rows of one batch; KTO: the completion + its KL row, run as two batches of the same size)
MEMBER_PREFIXES = ('chosen_', 'rejected_')


def row_cost(value: Any) -> int:
    """Padded tokens one sample costs in a micro-batch, per sample, as the collator runs it.

    ``value`` is an int (one row) or the sample's ``lengths`` list, one entry per row the collator makes from it
    (``swift rlhf``: ``[chosen, rejected]``). A micro-batch of ``n`` such samples runs ``n * len(lengths)`` rows
    padded to the longest, so a sample costs ``len(lengths) * max(lengths)``: exact for DPO/ORPO (both rows in one
    padded batch), an upper bound for KTO (completion and KL rows padded as two batches). An int or a one-entry list
    (``swift sft``) is the row's length.
    """
    if isinstance(value, (list, tuple)):
        return len(value) * int(max(value)) if value else 0
    return int(value)


def row_tokens(value: Any) -> int:
    """Real (unpadded) tokens of one sample: the sum of its rows' lengths."""
    if isinstance(value, (list, tuple)):
        return int(sum(value))
    return int(value)


def item_lengths(item: Any, index: int = -1) -> list[int]:
    """The rows' lengths of one encoded sample: its ``lengths`` field (ms-swift's ``return_length``), else
    ``max(len(input_ids), len(labels))`` of the row, or of each ``chosen_`` / ``rejected_`` row (``swift rlhf``)."""
    fields = item if isinstance(item, Mapping) else {}
    given = fields.get('lengths')
    if given is not None:
        return [int(x) for x in given] if isinstance(given, (list, tuple)) else [int(given)]
    rows = []
    for prefix in ('', ) + MEMBER_PREFIXES:
        sizes = [len(fields[prefix + k]) for k in ('input_ids', 'labels') if fields.get(prefix + k) is not None]
        if sizes:
            rows.append(max(sizes))
    if not rows:
        raise ValueError(f'cannot measure sample {index}: no input_ids/labels (a lengths column would do)')
    return rows


def dataset_lengths(dataset: Any) -> list[int]:
    """Padded-token cost of every sample of ``dataset`` (:func:`row_cost`), computed once and cached with it.

    Read, in this order: the ``lengths`` (ms-swift's encoded datasets: an int or a list per row, one entry per row
    the collator makes: ``[chosen, rejected]`` under ``swift rlhf``) or ``length`` column of a ``datasets.Dataset``,
    of the ``dataset`` attribute of a lazy wrapper (ms-swift's ``LazyLLMDataset``), or a ``lengths`` attribute.
    Otherwise every sample is read once and measured (:func:`item_lengths`); the result is kept on the dataset object
    (``_sdc_lengths``), so later epochs, plan changes and resumes do not encode anything again. Where a sample is
    several rows, its real tokens (:func:`row_tokens`) are kept too (``_sdc_real_tokens``,
    :func:`dataset_real_tokens`), for the logged padding.
    """
    cached = getattr(dataset, _LENGTHS_ATTR, None)
    if cached is not None and len(cached) == len(dataset):
        return cached
    values: list[Any] | None = None
    for source in (dataset, getattr(dataset, 'dataset', None)):
        columns = getattr(source, 'column_names', None) or ()
        if source is not None and len(source) == len(dataset):
            for column in ('lengths', 'length'):
                if column in columns:
                    values = list(source[column])
                    break
        if values is not None:
            break
    if values is None and isinstance(getattr(dataset, 'lengths', None), (list, tuple)):
        values = list(dataset.lengths)
    if values is None:
        values = [item_lengths(dataset[i], i) for i in range(len(dataset))]
    lengths = [row_cost(v) for v in values]
    real = [row_tokens(v) for v in values]
    for attr, value in ((_LENGTHS_ATTR, lengths), (_REAL_ATTR, real if real != lengths else None)):
        try:
            setattr(dataset, attr, value)
        except (AttributeError, TypeError):
            pass
    return lengths


def dataset_real_tokens(dataset: Any) -> list[int] | None:
    """Real tokens of every sample where they differ from :func:`dataset_lengths` (samples of several rows), else
    ``None``. Call after :func:`dataset_lengths`."""
    real = getattr(dataset, _REAL_ATTR, None)
    return real if real is not None and len(real) == len(dataset) else None


def dataset_media_tokens(dataset: Any, token_ids: Sequence[int]) -> list[int] | None:
    """Each encoded sample's media tokens: its ``input_ids`` equal to one of ``token_ids`` (a vision-language
    template's image and video placeholders, one a token the language model sees), read from the dataset's (or a lazy
    wrapper's) ``input_ids`` column, else from each sample. ``None``: no ``token_ids``, or a sample without
    ``input_ids``."""
    if not token_ids:
        return None
    wanted = {int(t) for t in token_ids}
    rows: Any = None
    for source in (dataset, getattr(dataset, 'dataset', None)):
        if source is not None and 'input_ids' in (getattr(source, 'column_names', None) or ()) \
                and len(source) == len(dataset):
            rows = source['input_ids']
            break
    if rows is None:
        rows = [item.get('input_ids') if isinstance(item, Mapping) else None
                for item in (dataset[i] for i in range(len(dataset)))]
    if any(ids is None for ids in rows):
        return None
    return [sum(1 for t in _plain_ids(ids) if not isinstance(t, list) and t in wanted) for ids in rows]


def dataset_fingerprint(dataset: Any, samples: int = 8) -> dict[str, Any]:
    """``{'size', 'sha256'}`` of a training dataset: its length and a hash of the token ids of up to ``samples``
    evenly spaced rows (cheap: with lazy tokenisation only those rows are encoded). A resume compares it with the
    checkpoint's, so a saved data position never points into another dataset. ``sha256`` is ``None`` when the rows
    have no ``input_ids``."""
    size = len(dataset)
    digest = hashlib.sha256(str(size).encode())
    picked = sorted({round(i * (size - 1) / max(samples - 1, 1)) for i in range(min(samples, size))}) if size else []
    for index in picked:
        item = dataset[index]
        ids = _sample_ids(item) if isinstance(item, Mapping) else None
        if ids is None:
            return {'size': size, 'sha256': None}
        digest.update(repr(ids).encode())
    return {'size': size, 'sha256': digest.hexdigest()}


def _sample_ids(item: Mapping[str, Any]) -> list[Any] | None:
    """The token ids of an encoded sample, as plain ints: its ``input_ids`` (a list per row where a sample is several
    rows: a reranker's documents), else every ``<prefix>_input_ids`` in key order (an embedding sample's anchor,
    positive and negatives); ``None`` when it has none."""
    if item.get('input_ids') is not None:
        return _plain_ids(item['input_ids'])
    keys = sorted(k for k in item if k.endswith('_input_ids') and item[k] is not None)
    return [[k, _plain_ids(item[k])] for k in keys] or None


def _plain_ids(ids: Any) -> list[Any]:
    return [_plain_ids(x) if isinstance(x, (list, tuple)) or getattr(x, 'ndim', 0) > 0 else int(x) for x in ids]


class RowLengths:
    """The cost (:func:`row_cost`) and real tokens of every dataset index, read once, when a batch plan first needs
    them; when they are estimates (a lazy dataset, ``estimated``), each row's real cost replaces its estimate as the
    row is encoded (:meth:`refine`).

    Args:
        size: samples in the dataset (the lengths must match it).
        costs: ``() -> cost of every index``, or None (a loader that never plans by length).
        real: ``() -> real tokens of every index, or None`` (None: the costs), called once after ``costs``.
        vision: ``() -> each index's vision-tower work in tokens of the pass cost model, or None`` (none priced),
            called once, when passes are first planned by tokens.
    """

    def __init__(self, size: int, costs: Callable[[], Sequence[int]] | None,
                 real: Callable[[], Sequence[int] | None] | None = None,
                 vision: Callable[[], Sequence[int] | None] | None = None) -> None:
        self.size = size
        self.estimated = False
        self._costs_fn, self._real_fn, self._vision_fn = costs, real, vision
        self._costs: list[int] | None = None
        self._real: list[int] | None = None
        self._vision: list[int] | None = None
        self._vision_read = False

    @property
    def costs(self) -> list[int]:
        """Tokens of every dataset index (read on first use)."""
        if self._costs is None:
            if self._costs_fn is None:
                raise ValueError('a batch plan needs the samples\' lengths, but this loader was built without them')
            costs = [int(x) for x in self._costs_fn()]
            if len(costs) != self.size:
                raise ValueError(f'got {len(costs)} lengths for a dataset of {self.size} samples')
            self._costs = costs
            real = self._real_fn() if self._real_fn is not None else None
            self._real = [int(x) for x in real] if real is not None else costs
        return self._costs

    @property
    def vision(self) -> list[int] | None:
        """Each index's vision-tower work in tokens (read on first use; ``None``: none priced)."""
        if not self._vision_read:
            self.costs  # noqa: B018  (the lengths first: a lazy dataset's estimate counts the rows' media)
            work = self._vision_fn() if self._vision_fn is not None else None
            if work is not None and len(work) != self.size:
                raise ValueError(f'got {len(work)} vision costs for a dataset of {self.size} samples')
            self._vision = [int(x) for x in work] if work is not None and any(work) else None
            self._vision_read = True
        return self._vision

    @property
    def real(self) -> list[int]:
        """Real tokens of every dataset index (the costs, unless a sample is several rows)."""
        self.costs  # noqa: B018
        return self._real

    def refine(self, indices: Sequence[int], costs: Sequence[int | None]) -> None:
        """Replace the estimates of ``indices`` by the real costs of their rows just encoded (None: unknown)."""
        table, real = self.costs, self._real
        for i, cost in zip(indices, costs):
            if cost is not None:
                table[i] = cost
                if real is not table:
                    real[i] = cost
