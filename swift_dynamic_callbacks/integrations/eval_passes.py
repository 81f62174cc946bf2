"""Evaluation an OOM cannot end: an eval batch that runs out of memory runs again in halves, with the same results.

HF's ``prediction_step`` returns, for one eval batch, its loss (the model's mean over the batch's label tokens: eval
calls the loss without ``num_items_in_batch``), its logits and its labels. When it raises an OOM, :class:`EvalPasses`
frees memory and runs the batch as two halves of rows (cut by the run's input kind, as training passes are: a
Qwen-VL batch at its rows' images), each half again in halves if it runs out of memory too, down to one row; the
halves' results are put together as the whole batch's: the loss weighted by each half's label tokens (after the
causal shift; rows for a loss that is a mean over rows), logits and labels concatenated along the rows (a half keeps
the batch's padding, so the shapes match). Metrics computed from them are the uncut batch's. Later eval batches of
the run are cut in advance to the largest half that ran (``cap``, saved with the pack's state).

Where a batch cannot be cut with the same results it is not (recovery off, said once at train start in an
``eval_oom_recovery`` record, and an eval OOM ends the run as before): generation (``predict_with_generate``: halves
would generate to different lengths), a loss that does not add up over pieces, a batch the run may not cut (pairs,
retrieval, a key the input kind does not know), and several processes (one rank's retry put a 2-process DDP run's
eval collectives out of step; FSDP2 and ZeRO-3 gather parameters in every eval forward): until the agreed retry of
an OOM on any rank covers eval.

Used by :class:`~.hooks.DynamicTrainerMixin` (``prediction_step``). Records: ``eval_oom_recovery`` (on / off, at
train start), ``oom`` (``phase: eval``, each recovered OOM). State: ``cap``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch

from ..device_memory import device_figures, free_memory, is_oom
from ..records import DecisionRecord
from .loss_kind import LossKind, piece_weights
from .passes import batch_shape, split_micro_batch

logger = logging.getLogger('swift_dynamic_callbacks')

#: what HF's ``prediction_step`` returns: ``(loss, logits, labels)``, each may be ``None``
Prediction = tuple[Any, Any, Any]


def eval_loss_kind(training: LossKind) -> LossKind:
    """The kind of the loss an eval batch returns: a training token sum is normalised by ``num_items_in_batch``,
    which eval does not pass, so the model averages over the batch's label tokens (``token_mean``, shifted for a
    causal LM); a mean over tokens or rows stays one; ``unknown`` stays unknown."""
    if training.kind == 'token_sum':
        return LossKind('token_mean', training.setting, training.why, shift=True)
    return training


def put_together(parts: Sequence[Prediction], weights: Sequence[float] | None) -> Prediction:
    """The results of a batch's pieces as the whole batch's: the losses weighted (``None``: the one piece's), logits
    and labels concatenated along the rows (a tuple of tensors element by element)."""
    losses = [p[0] for p in parts]
    if any(loss is None for loss in losses):
        loss = None
    elif weights is None:
        loss = losses[0]
    else:
        loss = sum(w * torch.as_tensor(x).to(torch.float32) for w, x in zip(weights, losses) if w > 0)
        loss = loss.to(torch.as_tensor(losses[0]).dtype)
    return loss, _concat([p[1] for p in parts]), _concat([p[2] for p in parts])


def _concat(values: Sequence[Any]) -> Any:
    if any(v is None for v in values):
        return None
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(values), dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([v[i] for v in values]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: _concat([v[k] for v in values]) for k in first}
    raise TypeError(f'cannot put an eval batch\'s pieces together: a result of type {type(first).__name__}')


class EvalPasses:
    """An eval batch's OOM recovered in halves (module docstring).

    Args:
        runner: the step runner (its input kind, loss kind, engine and split rule decide what may be cut).
        write: where a record goes (written at once: eval runs between step boundaries).
    """

    state_key = 'integration.eval_passes'

    def __init__(self, runner: Any, write: Callable[[DecisionRecord], None]) -> None:
        self.runner = runner
        self.write = write
        self.off: str | None = 'not started'  # why recovery is off (None: on)
        self.cap: int | None = None  # the most rows an eval pass holds after an OOM (None: the batch's)
        self.oom_count = 0
        self.loss = LossKind('token_mean', None, '', shift=True)

    def begin(self, trainer: Any) -> DecisionRecord:
        """At train start (after the step runner's ``begin``): whether eval OOMs are recovered, and why not."""
        from .. import distributed
        args = trainer.args
        self.loss = eval_loss_kind(self.runner.loss)
        off = None
        if getattr(args, 'predict_with_generate', False):
            off = 'predict_with_generate: the halves of a batch would generate to different lengths'
        elif not self.loss.splittable:
            off = f'{self.loss.setting}: {self.loss.why}'
        elif self.runner.split_refusal() is not None:
            off = self.runner.split_refusal()
        elif distributed.world_size() > 1:
            off = (f'{distributed.world_size()} processes: a rank\'s retry in halves puts its eval out of step with '
                   'the other ranks\' collectives (a 2-process DDP run desynchronised); the agreed retry is to come')
        self.off = off
        message = 'eval OOM recovery ' + ('on: an eval batch that runs out of memory runs again in halves'
                                          if off is None else f'off ({off})')
        return DecisionRecord('integration', 'eval_oom_recovery', 'on' if off is None else 'off',
                              {'on': off is None, 'why': off, 'cap': self.cap}, message)

    def run(self, model: Any, inputs: Any, predict: Callable[[Any], Prediction]) -> Prediction:
        """One eval batch through ``predict`` (HF's ``prediction_step`` of a piece), in pieces of at most
        :attr:`cap` rows once an OOM set it, in halves when it runs out of memory."""
        rows = batch_shape(inputs)[0] if isinstance(inputs, Mapping) else 1
        if self.off is None and self.cap is not None and rows > self.cap:
            return self._pieces(model, inputs, predict, -(-rows // self.cap))
        try:
            return predict(inputs)
        except Exception as error:  # noqa: BLE001 - only an OOM is handled; anything else is raised as it was
            if self.off is not None or rows <= 1 or not is_oom(error):
                raise
        free_memory()  # outside the except block: the traceback no longer pins the failed forward's tensors
        self.oom_count += 1
        half = -(-rows // 2)
        self.cap = half if self.cap is None else min(self.cap, half)
        message = (f'out of memory in an eval batch of {rows} rows: run again as 2 halves, its loss put together '
                   f'from theirs; eval batches hold at most {self.cap} rows from now on')
        logger.warning(message)
        self.write(DecisionRecord('integration', 'oom', 'recovered', {
            'phase': 'eval', 'rows': rows, 'eval_cap': self.cap, 'oom_count': self.oom_count,
            'memory': device_figures()}, message))
        return self._pieces(model, inputs, predict, 2)

    def _pieces(self, model: Any, inputs: Any, predict: Callable[[Any], Prediction], pieces: int) -> Prediction:
        parts = split_micro_batch(inputs, pieces, self.runner.kind)
        labelled = self.loss.kind == 'row_mean' or all(isinstance(p.get('labels'), torch.Tensor) for p in parts)
        weights = piece_weights(self.loss, parts) if labelled else None  # no labels: no loss to put together
        results = [self.run(model, part, predict) for part in parts]
        return put_together(results, weights if len(parts) > 1 else None)

    def state_dict(self) -> dict[str, Any]:
        return {'cap': self.cap, 'oom_count': self.oom_count}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        state = state or {}
        self.cap = state.get('cap')
        self.oom_count = int(state.get('oom_count', 0))
