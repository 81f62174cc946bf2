"""Settings of the ``checkpoint_rotation`` callback (YAML key ``dynamic_callbacks.checkpoint_rotation``); no torch."""

from __future__ import annotations

from dataclasses import dataclass

from . import Choice, Int, Reads, Settings, Text, setting


@dataclass(frozen=True)
class CheckpointRotationConfig(Settings):
    """Settings of :class:`CheckpointRotationCallback` (YAML key ``dynamic_callbacks.checkpoint_rotation``).

    Attributes:
        keep_last: newest checkpoints to keep (>= 1: the newest is always kept).
        keep_best: best checkpoints to keep by ``metric`` (0: none beyond the newest).
        metric: the value that ranks checkpoints, as logged (``eval_loss``, ``eval_token_acc``, ``loss``): a
            checkpoint's value is the one logged at its own step, read from its ``trainer_state.json``. A name
            without the ``eval_`` prefix that is not logged falls back to ``eval_<name>`` (as HF's
            ``metric_for_best_model``). Checkpoints saved at a step without a finite value (``save_steps`` not a
            multiple of ``eval_steps``, a NaN, or a ``loss`` logged for steps with a non-finite loss:
            ``dynamic/nonfinite_steps`` > 0 in that log line) are never "best": ``keep_last`` alone keeps them.
        mode: ``min`` (lower is better) or ``max``.

    ``metric`` and ``mode`` are read only with ``keep_best >= 1`` (the ``reads`` table).
    """

    keep_last: int = setting(Int(1), 2)
    keep_best: int = setting(Int(0), 1)
    metric: str = setting(Text('eval_loss'), 'eval_loss')
    mode: str = setting(Choice(('min', 'max')), 'min')

    reads = (Reads('keep_best', {'>= 1': ('metric', 'mode'), '0': ()}, classify=lambda n: '>= 1' if n >= 1 else '0'), )
    controls = ()  # deletes files, requests nothing; HF's own rotation (save_total_limit) is refused instead
