"""Checkpoint rotation: keep the last N and the best k checkpoints, never the ones a run needs."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..config.checkpoint_rotation import CheckpointRotationConfig
from ..policies.rotation import PREFIX, checkpoint_step, select_for_deletion
from ..records import DecisionRecord
from .base import DynamicCallback

logger = logging.getLogger(__name__)

TRAINER_STATE = 'trainer_state.json'  # HF writes it last in _save_checkpoint: its presence marks a complete save
LAST_CHECKPOINT_LINK = 'last-checkpoint'  # ms-swift's link to the newest checkpoint


def read_trainer_state(checkpoint_dir: str) -> dict[str, Any] | None:
    """The checkpoint's ``trainer_state.json``, or ``None`` when it is missing or unreadable (incomplete save)."""
    try:
        with open(os.path.join(checkpoint_dir, TRAINER_STATE), encoding='utf-8') as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_metric(trainer_state: Mapping[str, Any], step: int, metric: str) -> float | None:
    """The value of ``metric`` logged at ``step`` in ``log_history`` (``eval_<metric>`` as a fallback), if finite.

    ``None`` (never "best") when it is missing, not a number, NaN / inf, or the ``loss`` of a training log line
    whose steps had a non-finite loss (``dynamic/nonfinite_steps`` > 0: HF logged a finite substitute).
    """
    names = [metric] if metric.startswith('eval_') else [metric, f'eval_{metric}']
    for name in names:
        for entry in reversed(trainer_state.get('log_history') or []):
            if isinstance(entry, Mapping) and entry.get('step') == step and name in entry:
                value = entry[name]
                if name == 'loss' and (entry.get(protocol.NONFINITE_LOG_KEY) or 0) > 0:
                    return None
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    return float(value)
    return None


def _link_target(output_dir: str) -> str | None:
    link = os.path.join(output_dir, LAST_CHECKPOINT_LINK)
    if not os.path.islink(link):
        return None
    return os.path.basename(os.path.normpath(os.path.realpath(link)))


def _same_dir(path: Any, output_dir: str) -> bool:
    return isinstance(path, str) and os.path.realpath(os.path.dirname(os.path.normpath(path))) == os.path.realpath(
        output_dir)


class CheckpointRotationCallback(DynamicCallback):
    """Deletes old checkpoints of this run's ``output_dir``, keeping the last ``keep_last`` and best ``keep_best``.

    Hooks: ``on_train_begin`` (refuses HF's ``save_total_limit``: two rotations would delete each other's
    keepers), ``on_save`` (rank 0 only, after HF wrote the checkpoint completely: lists the complete
    ``checkpoint-<N>`` directories, ordered by ``N``, and deletes what :func:`select_for_deletion` selects).
    Never deleted: the newest complete checkpoint and the one just saved, the best ``keep_best``, the checkpoint
    the run resumed from (``args.resume_from_checkpoint``), the target of ms-swift's ``last-checkpoint`` link,
    HF's ``state.best_model_checkpoint``, symlinks, and directories without a readable ``trainer_state.json``
    (incomplete: a save that crashed is neither counted nor deleted). Nothing is deleted while the checkpoint
    just saved is incomplete, so a crash during a save always leaves the previous checkpoint loadable.
    Flags set: ``dynamic_decisions`` (one ``delete_checkpoint`` record per deletion).
    State: none (the metrics are read from each checkpoint's ``trainer_state.json``, so they survive resume).
    """

    name = 'checkpoint_rotation'
    config_class = CheckpointRotationConfig

    def __init__(self, config: CheckpointRotationConfig | None = None) -> None:
        super().__init__(config)
        self.deleted: list[str] = []  # this process's deletions (for reports and tests; not checkpointed)

    def on_train_begin(self, args, state, control, **kwargs):
        limit = getattr(args, 'save_total_limit', None)
        if limit is not None and limit > 0:
            raise ConfigError(f'save_total_limit: checkpoint_rotation deletes checkpoints itself, so HF\'s '
                              f'save_total_limit must be unset, got {limit}; use dynamic_callbacks.checkpoint_rotation.'
                              f'keep_last (now {self.config.keep_last}) and keep_best (now {self.config.keep_best}) '
                              'instead')

    def on_save(self, args, state, control, **kwargs):
        if not distributed.is_main_process():
            return
        output_dir = args.output_dir
        current = f'{PREFIX}-{state.global_step}'
        if read_trainer_state(os.path.join(output_dir, current)) is None:
            logger.warning('checkpoint_rotation: %s is not complete (no readable %s); nothing deleted', current,
                           TRAINER_STATE)
            return
        complete: dict[str, dict[str, Any]] = {}
        for name in os.listdir(output_dir):
            path = os.path.join(output_dir, name)
            if checkpoint_step(name) is None or os.path.islink(path) or not os.path.isdir(path):
                continue
            trainer_state = read_trainer_state(path)
            if trainer_state is not None:
                complete[name] = trainer_state
        metrics = {}
        for name, trainer_state in complete.items():
            value = checkpoint_metric(trainer_state, checkpoint_step(name), self.config.metric)
            if value is not None:
                metrics[name] = value
        protected = self._protected(args, state, output_dir, current)
        selected = select_for_deletion(sorted(complete), keep_last=self.config.keep_last,
                                       keep_best=self.config.keep_best, metrics=metrics, mode=self.config.mode,
                                       protected=protected)
        kept = sorted((n for n in complete if n not in selected), key=checkpoint_step)
        for name in selected:
            shutil.rmtree(os.path.join(output_dir, name))
            self.deleted.append(name)
            protocol.record_decision(
                control,
                DecisionRecord(
                    self.name, 'delete_checkpoint', 'rotation', {
                        'checkpoint': name,
                        'checkpoint_step': checkpoint_step(name),
                        'metric': self.config.metric,
                        'value': metrics.get(name),
                        'kept': kept,
                        'protected': sorted(set(protected)),
                    },
                    f'deleted {name} (keep_last {self.config.keep_last}, keep_best {self.config.keep_best} by '
                    f'{self.config.metric} {self.config.mode}); kept {", ".join(kept)}',
                    step=state.global_step))

    def _protected(self, args: Any, state: Any, output_dir: str, current: str) -> list[str]:
        """Names that are never deleted: the checkpoint just saved, the one resumed from, HF's best, the link target."""
        protected = [current]
        for path in (getattr(args, 'resume_from_checkpoint', None), getattr(state, 'best_model_checkpoint', None)):
            if isinstance(path, str) and _same_dir(path, output_dir):
                protected.append(os.path.basename(os.path.normpath(path)))
        target = _link_target(output_dir)
        if target is not None:
            protected.append(target)
        return protected
