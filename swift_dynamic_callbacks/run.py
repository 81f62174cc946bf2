"""One ms-swift training with the pack, in this process, and what it wrote: the public way to run the pack from
Python (benchmarks, studies, tests, notebooks) without the command line.

    from swift_dynamic_callbacks import run
    result = run.sft({'model': 'models/tiny-qwen2', 'dataset': ['train.jsonl'], 'output_dir': 'out/a', ...},
                     pack={'batch_schedule': {'schedule': {0: 4}}}, callbacks=['batch_schedule'])
    result.train_logs[-1]['loss'], result.decisions[0]['kind']

:func:`sft` (and :func:`rlhf`, :func:`pt`) registers the pack with ``pack`` (and any extra ms-swift callback factories
in ``extra``) for this one run, runs ms-swift's ``sft_main`` (``rlhf_main``, ``pretrain_main``), undoes the
registration whatever happens (:func:`registered`), and reads back the output folder. Several runs in one process are
independent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

#: ms-swift callback factory: ``(args, trainer) -> TrainerCallback``
Factory = Callable[[Any, Any], Any]


@dataclass
class RunResult:
    """What one run wrote (read after it ended).

    Attributes:
        output_dir: the run's output folder.
        wall_s: seconds ``sft_main`` (``rlhf_main``, ``pretrain_main``) took, model loading included.
        summary: what ms-swift's main returned.
        logs: every line of ``logging.jsonl`` (the last one is ms-swift's summary).
        decisions: every record of ``dynamic_decisions.jsonl`` (empty when the pack wrote none).
    """

    output_dir: str
    wall_s: float
    summary: Any = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def train_logs(self) -> list[dict[str, Any]]:
        """The per-step training lines (those with a ``loss``, not an ``eval_loss``)."""
        return [r for r in self.logs if 'loss' in r and 'eval_loss' not in r]

    def records(self, kind: str) -> list[dict[str, Any]]:
        """The decision records of ``kind``."""
        return [d for d in self.decisions if d.get('kind') == kind]


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


@contextlib.contextmanager
def registered(pack: Mapping[str, Any] | None = None,
               extra: Mapping[str, Factory] | None = None) -> Iterator[Any]:
    """The pack registered in ms-swift's ``callbacks_map`` with the settings ``pack`` (validated now), and the
    factories ``extra`` under their names, for the ``with`` block; both undone when it ends. Yields the validated
    settings (``PackConfig``)."""
    from swift.callbacks import callbacks_map

    from .integrations import swift as plugin
    saved = {name: callbacks_map.get(name) for name in (extra or {})}
    callbacks_map.update(extra or {})
    try:
        yield plugin.register(dict(pack or {}))
    finally:
        plugin.unregister()
        for name, factory in saved.items():
            if factory is None:
                callbacks_map.pop(name, None)
            else:
                callbacks_map[name] = factory


def _run(main: str, arguments_class: str, arguments: Mapping[str, Any], *, pack: Mapping[str, Any] | None,
         callbacks: Sequence[str] | None, extra: Mapping[str, Factory] | None, fresh: bool) -> RunResult:
    import swift
    kwargs = dict(arguments)
    if callbacks is not None:
        kwargs['callbacks'] = list(callbacks)
    output_dir = str(kwargs.get('output_dir') or '')
    if not output_dir:
        raise ValueError('output_dir: a run needs its own output folder (ms-swift appends to an existing log)')
    if fresh:
        shutil.rmtree(output_dir, ignore_errors=True)
    with registered(pack, extra):
        start = time.perf_counter()
        summary = getattr(swift, main)(getattr(swift, arguments_class)(**kwargs))
        wall = time.perf_counter() - start
    return RunResult(output_dir, wall, summary, _read_jsonl(os.path.join(output_dir, 'logging.jsonl')),
                     _read_jsonl(os.path.join(output_dir, 'dynamic_decisions.jsonl')))


def sft(arguments: Mapping[str, Any], *, pack: Mapping[str, Any] | None = None, callbacks: Sequence[str] | None = None,
        extra: Mapping[str, Factory] | None = None, fresh: bool = True) -> RunResult:
    """One ``swift sft`` in this process: ``arguments`` are ``SftArguments`` keyword arguments (``output_dir``
    required; emptied first unless ``fresh=False``, e.g. to resume), ``pack`` the ``dynamic_callbacks:`` settings,
    ``callbacks`` ms-swift's ``callbacks`` list (default: ``arguments``'), ``extra`` more callback factories by
    name (listed in ``callbacks`` to run)."""
    return _run('sft_main', 'SftArguments', arguments, pack=pack, callbacks=callbacks, extra=extra, fresh=fresh)


def rlhf(arguments: Mapping[str, Any], *, pack: Mapping[str, Any] | None = None, callbacks: Sequence[str] | None = None,
         extra: Mapping[str, Factory] | None = None, fresh: bool = True) -> RunResult:
    """One ``swift rlhf`` in this process (``RLHFArguments``); see :func:`sft`."""
    return _run('rlhf_main', 'RLHFArguments', arguments, pack=pack, callbacks=callbacks, extra=extra, fresh=fresh)


def pt(arguments: Mapping[str, Any], *, pack: Mapping[str, Any] | None = None, callbacks: Sequence[str] | None = None,
       extra: Mapping[str, Factory] | None = None, fresh: bool = True) -> RunResult:
    """One ``swift pt`` (continued pretraining) in this process (``PretrainArguments``); see :func:`sft`."""
    return _run('pretrain_main', 'PretrainArguments', arguments, pack=pack, callbacks=callbacks, extra=extra,
                fresh=fresh)
