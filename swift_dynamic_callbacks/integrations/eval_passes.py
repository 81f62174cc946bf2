"""Evaluation an OOM cannot end: an eval batch that runs out of memory runs again in halves, with the same results.

HF's ``prediction_step`` returns, for one eval batch, its loss, its logits and its labels. When it raises an OOM,
:class:`EvalPasses` frees memory and runs the batch as two halves of rows (cut by the run's input kind, as training
passes are: a Qwen-VL batch at its rows' images), each half again in halves if it runs out of memory too, down to one
row; the halves' results are put together as the whole batch's: logits and labels concatenated along the rows
(padded at the end to the longest piece's, as HF pads batches of other lengths: ms-swift keeps a piece's logits from
its first label position on), and the loss as the whole batch's loss. Metrics computed from them are the uncut
batch's. Later eval batches of the run are cut in advance to the largest half that ran (``cap``, saved with the pack's
state).

The loss. transformers (4.57.6 and 5) counts an eval batch's label tokens before its loss and passes the count
(``num_items_in_batch``, summed over the ranks: one collective a batch) to the loss, which is then the batch's
token sum over that count. Each piece of a batch is given the whole batch's count, counted once, when the first piece
asks (:meth:`EvalPasses.num_items`, through the trainer mixin's ``_get_num_items_in_batch``): the pieces' losses add up
to the whole batch's, and every rank makes one count collective a batch whatever its pieces, so a rank that runs a
batch again in halves stays in step with the others (DDP: its eval forwards enter no other collective). Where no count
is passed (a model that takes no loss arguments) or the loss is a mean whatever the count (label smoothing, sequence
classification), it is a mean over the piece's label tokens or rows, and the pieces are weighted by their share.

Where a batch cannot be cut with the same results it is not (recovery off, said once at train start in an
``eval_oom_recovery`` record, and an eval OOM ends the run as before): generation (``predict_with_generate``: halves
would generate to different lengths), a loss that does not add up over pieces, a batch the run may not cut (pairs,
retrieval, a key the input kind does not know), and an engine whose eval forwards enter collectives (FSDP2 and ZeRO-3
gather parameters in every forward: :attr:`~.engines.base.Engine.eval_alone`) or sequence parallelism (the group
exchanges activations in every forward): until the agreed retry of an OOM on any rank covers eval.

Used by :class:`~.hooks.DynamicTrainerMixin` (``prediction_step``, ``_get_num_items_in_batch``) and the integration
callback (``on_evaluate``: :meth:`EvalPasses.end_eval`). Records: ``eval_oom_recovery`` (on / off, at train start),
``oom`` (``phase: eval``, each recovered OOM, with the rank it happened on: written when the eval ends). State:
``cap`` (this rank's).
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


def eval_loss_kind(training: LossKind, counted: bool = False) -> LossKind:
    """The kind of the loss an eval batch returns: a training token sum is normalised by ``num_items_in_batch``; where
    eval passes the batch's count (``counted``) it stays a token sum over a given count, where it passes none the
    model averages over the batch's label tokens (``token_mean``, shifted for a causal LM); a mean over tokens or rows
    stays one; ``unknown`` stays unknown."""
    if training.kind == 'token_sum' and not counted:
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
        return torch.cat(_padded(values), dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([v[i] for v in values]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: _concat([v[k] for v in values]) for k in first}
    raise TypeError(f'cannot put an eval batch\'s pieces together: a result of type {type(first).__name__}')


def _padded(tensors: Sequence[torch.Tensor], value: int = -100) -> list[torch.Tensor]:
    """``tensors`` padded at the end of every dimension but the rows to the largest, with ``value`` (-100: what HF's
    evaluation loop pads batches of other lengths with). A piece's logits and labels can be shorter than the whole
    batch's: ms-swift keeps the logits from the first label position of the piece's rows on (``logits_to_keep``; one
    row: its label positions only); a row's logits and labels are padded alike, so every metric that compares them
    position by position and skips -100 labels is the uncut batch's."""
    if len({t.shape[1:] for t in tensors}) <= 1:
        return list(tensors)
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = []
    for t in tensors:
        pad: list[int] = []
        for d in reversed(range(1, t.dim())):
            pad += [0, shape[d - 1] - t.shape[d]]
        out.append(torch.nn.functional.pad(t, pad, value=value))
    return out


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
        self.training_loss = LossKind('token_sum', None, '')  # the run's (its eval kind: :func:`eval_loss_kind`)
        self._whole: Any = None  # the eval batch being run (None: none), whose pieces share its label count
        self._count: tuple[Any] | None = None  # that batch's count, once counted (a 1-tuple: the count may be None)
        self.pending: list[DecisionRecord] = []  # this rank's ``oom`` records of the eval under way

    def begin(self, trainer: Any) -> DecisionRecord:
        """At train start (after the step runner's ``begin``): whether eval OOMs are recovered, and why not."""
        from .. import distributed
        args = trainer.args
        self.training_loss = self.runner.loss
        loss = eval_loss_kind(self.runner.loss)
        engine = getattr(self.runner, 'engine', None)
        off = None
        if getattr(args, 'predict_with_generate', False):
            off = 'predict_with_generate: the halves of a batch would generate to different lengths'
        elif not loss.splittable:
            off = f'{loss.setting}: {loss.why}'
        elif self.runner.split_refusal() is not None:
            off = self.runner.split_refusal()
        elif distributed.world_size() > 1 and engine is not None and not engine.eval_alone:
            off = (f'{engine.name} on {distributed.world_size()} processes: every eval forward enters the engine\'s '
                   'collectives, so a rank that runs a batch again would leave the other ranks waiting (the agreed '
                   'retry of an OOM on any rank is to come)')
        elif distributed.sequence_parallel_size() > 1:
            off = (f'sequence_parallel_size: {distributed.sequence_parallel_size()}: the group exchanges activations '
                   'inside every eval forward, so a rank that runs a batch again would leave the others waiting')
        self.off = off
        message = 'eval OOM recovery ' + ('on: an eval batch that runs out of memory runs again in halves'
                                          if off is None else f'off ({off})')
        return DecisionRecord('integration', 'eval_oom_recovery', 'on' if off is None else 'off',
                              {'on': off is None, 'why': off, 'cap': self.cap}, message)

    def run(self, model: Any, inputs: Any, predict: Callable[[Any], Prediction]) -> Prediction:
        """One eval batch through ``predict`` (HF's ``prediction_step`` of a piece), in pieces of at most
        :attr:`cap` rows once an OOM set it, in halves when it runs out of memory."""
        if self._whole is not None:  # a piece of the batch being run
            return self._run(model, inputs, predict)
        self._whole, self._count = inputs, None
        try:
            return self._run(model, inputs, predict)
        finally:
            self._whole, self._count = None, None

    def end_eval(self) -> None:
        """After an eval (``on_evaluate``, on every rank): its ``oom`` records written, every rank's (gathered: one
        collective an eval while recovery is on; the log is rank 0's)."""
        if self.off is not None:
            return
        from .. import distributed
        pending, self.pending = self.pending, []
        for records in distributed.gather_objects(pending):
            for record in records:
                self.write(record)

    def num_items(self, batches: Sequence[Any], count: Callable[[Sequence[Any]], Any]) -> Any:
        """HF's label count for a loss (``count``: its ``_get_num_items_in_batch``, summed over the ranks). In an eval
        batch every piece gets the whole batch's, counted once; elsewhere (training) ``batches``' own."""
        if self._whole is None:
            return count(batches)
        if self._count is None:
            self._count = (count([self._whole]), )
        return self._count[0]

    def _run(self, model: Any, inputs: Any, predict: Callable[[Any], Prediction]) -> Prediction:
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
        from .. import distributed
        self.pending.append(DecisionRecord('integration', 'oom', 'recovered', {
            'phase': 'eval', 'rank': distributed.rank(), 'rows': rows, 'eval_cap': self.cap,
            'oom_count': self.oom_count, 'memory': device_figures()}, message))
        return self._pieces(model, inputs, predict, 2)

    def _pieces(self, model: Any, inputs: Any, predict: Callable[[Any], Prediction], pieces: int) -> Prediction:
        parts = split_micro_batch(inputs, pieces, self.runner.kind)
        results = [self._run(model, part, predict) for part in parts]
        if len(parts) == 1:
            return put_together(results, None)
        counted = self._count is not None and self._count[0] is not None  # each piece's loss over the whole count
        kind = eval_loss_kind(self.training_loss, counted)
        if kind.kind == 'token_sum':
            weights: Sequence[float] | None = [1.0] * len(parts)
        elif kind.kind == 'row_mean' or all(isinstance(p.get('labels'), torch.Tensor) for p in parts):
            weights = piece_weights(kind, parts)
        else:
            weights = None  # no labels: no loss to put together
        return put_together(results, weights)

    def state_dict(self) -> dict[str, Any]:
        return {'cap': self.cap, 'oom_count': self.oom_count}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        state = state or {}
        self.cap = state.get('cap')
        self.oom_count = int(state.get('oom_count', 0))
