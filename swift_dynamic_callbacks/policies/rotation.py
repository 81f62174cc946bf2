"""Which checkpoints to delete (pure function).

Checkpoints are named ``checkpoint-<N>`` (HF's ``PREFIX_CHECKPOINT_DIR``) and ordered by the step ``N`` in the
name, never by file times. :func:`select_for_deletion` keeps:

- the ``keep_last`` newest (at least the newest one, whatever ``keep_last`` says);
- the ``keep_best`` best by ``metrics`` (mode ``min`` or ``max``; only finite values count; ties keep the newer);
- everything in ``protected`` (the checkpoint resumed from, the ``last-checkpoint`` link target, ...);
- anything whose name is not ``checkpoint-<N>``;

and selects the rest, oldest first.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterable, Mapping, TypeVar

C = TypeVar('C', str, int)

PREFIX = 'checkpoint'
_NAME = re.compile(rf'^{PREFIX}-(\d+)$')


def checkpoint_step(checkpoint: str | int) -> int | None:
    """The step of ``checkpoint-<N>`` (a name or a path; an int is a step already), or ``None``."""
    if isinstance(checkpoint, bool):
        return None
    if isinstance(checkpoint, int):
        return checkpoint if checkpoint >= 0 else None
    match = _NAME.match(os.path.basename(os.path.normpath(str(checkpoint))))
    return int(match.group(1)) if match else None


def _key(checkpoint: str | int) -> tuple[str, object]:
    step = checkpoint_step(checkpoint)
    return ('step', step) if step is not None else ('name', os.path.basename(os.path.normpath(str(checkpoint))))


def select_for_deletion(checkpoints: Iterable[C], *, keep_last: int, keep_best: int = 0,
                        metrics: Mapping[str | int, float] | None = None, mode: str = 'min',
                        protected: Iterable[str | int] = ()) -> list[C]:
    """The checkpoints to delete, oldest first, in the form they were given (names, paths or steps).

    Args:
        checkpoints: complete checkpoints of one output directory (``checkpoint-<N>`` names/paths or steps).
        keep_last: how many of the newest to keep (values below 1 still keep the newest).
        keep_best: how many of the best by ``metrics`` to keep.
        metrics: ``{checkpoint (name, path or step): value}``; checkpoints without a finite value are never "best".
        mode: ``min`` (lower is better) or ``max``.
        protected: never selected (matched by step, or by name for other names).
    """
    if mode not in ('min', 'max'):
        raise ValueError(f'mode: must be min or max, got {mode!r}')
    items = list(checkpoints)
    steps = sorted({s for s in (checkpoint_step(c) for c in items) if s is not None})
    keep: set[tuple[str, object]] = {_key(p) for p in protected}
    keep.update(('step', s) for s in steps[-max(keep_last, 1):])
    if keep_best > 0 and metrics:
        scored: dict[int, float] = {}
        for name, value in metrics.items():
            step = checkpoint_step(name)
            if step in steps and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
                    value):
                scored[step] = float(value)
        sign = 1.0 if mode == 'min' else -1.0
        ranked = sorted(scored, key=lambda s: (sign * scored[s], -s))
        keep.update(('step', s) for s in ranked[:keep_best])
    selected = [c for c in items if checkpoint_step(c) is not None and _key(c) not in keep]
    return sorted(selected, key=lambda c: checkpoint_step(c))
