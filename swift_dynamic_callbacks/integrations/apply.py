"""Applying an agreed request at the step boundary: each field to the part that owns it, and one record each.

A request (``protocol.BatchRequest``) has one field per request kind (``protocol.REQUESTS``). :data:`FIELDS` (derived:
each kind's ``applier``, in the registry's order) lists the steps that apply them; each has one method here that
applies it and, unless a held record already tells the change (:meth:`~.decisions.Decisions.covers`), writes a
``control_flags`` record for it. Adding a request kind is its entry in ``protocol.REQUESTS`` and its method here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

from .. import protocol
from ..policies.length import BatchPlan, padding_fraction
from ..records import DecisionRecord
from .data import DataFeed
from .decisions import Decisions
from .layout import Layout
from .optimizer import OptimizerScale
from .auto_budget import agreed_auto_pass_tokens
from .lr import LRControl
from .metrics import global_batch_size
from .requests import changes_lr
from .steps import StepRunner

#: the steps that apply a request, in the registry's order (the batch before the plan cut from it; the LR after both)
FIELDS = tuple(dict.fromkeys(kind.applier for kind in protocol.REQUESTS))


class RequestApplier:
    """Applies requests to the integration's parts.

    Args:
        feed: owns the loader (batch size, plan, pieces).
        runner: owns the pass limit and says what may split.
        lr: owns the LR scale and schedule.
        decisions: the records.
        refresh_budget: ``reason -> None``: the step budget after a change of the batch size or plan.
        layout: converts requested per-device sizes to the current layout (a resume on another world size).
        optimizer: owns the optimizer's weight decay and beta2.
        pack_config: the pack's settings (``pass_tokens: auto`` reads ``memory_backoff.cpu_budget_gib`` on a CPU).
    """

    def __init__(self, feed: DataFeed, runner: StepRunner, lr: LRControl, decisions: Decisions,
                 refresh_budget: Callable[[str], None], layout: Layout, optimizer: OptimizerScale,
                 pack_config: Mapping[str, Any] | None = None) -> None:
        self.layout = layout
        self.optimizer = optimizer
        self.feed = feed
        self.runner = runner
        self.lr = lr
        self.decisions = decisions
        self.refresh_budget = refresh_budget
        self.pack_config = dict(pack_config or {})

    def apply(self, request: protocol.BatchRequest) -> None:
        for field in FIELDS:
            getattr(self, f'_{field}')(request)

    def _note(self, field: str, values: Mapping[str, Any], reason: str = 'request') -> None:
        if not self.decisions.covers(field):
            self.decisions.write(DecisionRecord('control_flags', field, reason, dict(values)))

    def _batch_size(self, request: protocol.BatchRequest) -> None:
        """A per-device size in the run's reference layout, converted to the current one (:mod:`.layout`)."""
        loader = self.feed.loader
        if request.batch_size is None:
            return
        size, exact = self.layout.per_device(request.batch_size)
        if size == loader.batch_size:
            return
        old = loader.batch_size
        loader.set_batch_size(size)
        self.refresh_budget('batch_size')
        values = {'old': old, 'new': size, 'global_batch_size': global_batch_size(loader)}
        if loader.balanced_steps:  # the rest of the epoch was laid out again for the new global batch
            relaid = {'balanced_layout': {'samples_left': loader.remaining, **loader.planned_spread()}}
            values.update(relaid)
            self.decisions.complete(lambda r: r.kind == 'batch_size', relaid)
        if self.layout.changed:
            values.update(requested=request.batch_size, global_batch_kept=exact)
            self.decisions.complete(lambda r: r.kind == 'batch_size', values)
        self._note('batch_size', values, 'new_dataloader' if request.via_dataloader else 'request')

    def _batch_plan(self, request: protocol.BatchRequest) -> None:
        """Hand the plan to the loader and add what it plans for the rest of the epoch to the plan's record."""
        if request.batch_plan is None:
            return
        loader = self.feed.loader
        plan = BatchPlan.from_json(request.batch_plan)
        old = loader.plan.to_json() if loader.plan is not None else None
        if plan.cuts_passes:  # a step's share in passes other than HF's micro-batches: where passes may split
            self.runner.check_splittable('length_batching.pass_tokens', 'pass_limit')
        if plan.pass_tokens == 'auto':
            plan = replace(plan, pass_tokens=self._auto_pass_tokens())
        attention = self.runner.set_padding_free(plan.padding_free, self.runner.trainer.model)
        if attention is not None:
            self.decisions.write(attention)
        if not loader.set_plan(plan):
            return
        self.refresh_budget('batch_plan')
        real, padded, batches = loader.planned_padding()
        applied = {'micro_batches_left': batches, 'planned_padding_fraction': round(padding_fraction(real, padded), 6),
                   'bucketed_from_epoch': loader.epoch if loader.order_bucketed else loader.epoch + 1}
        applied.update(loader.planned_spread())
        if self.decisions.covers('batch_plan'):
            self.decisions.complete(lambda r: r.kind == 'batch_plan', applied)
        else:
            self.decisions.hold(DecisionRecord('control_flags', 'batch_plan', 'request',
                                               {'old': old, 'new': request.batch_plan, **applied}))
        self.feed.report_over_budget(plan)

    def _auto_pass_tokens(self) -> int:
        """``pass_tokens: auto``: every rank's budget from its free memory and the model's shape; the smallest is
        planned at (collective: every rank applies the same plan at this boundary); a ``pass_tokens`` record."""
        budget = (self.pack_config.get('memory_backoff') or {}).get('cpu_budget_gib')
        chosen, record = agreed_auto_pass_tokens(self.runner.trainer, self.runner.engine, cpu_budget_gib=budget)
        self.decisions.write(record)
        return chosen

    def _num_pieces(self, request: protocol.BatchRequest) -> None:
        loader = self.feed.loader
        if request.num_pieces is None or request.num_pieces == loader.num_pieces:
            return
        if request.num_pieces > 1:
            self.runner.check_splittable('control.new_num_pieces')
        old = loader.num_pieces
        loader.set_num_pieces(request.num_pieces)
        self._note('num_pieces', {'old': old, 'new': request.num_pieces})

    def _pass_limit(self, request: protocol.BatchRequest) -> None:
        if request.pass_limit is None or request.pass_limit == self.runner.pass_limit:
            return
        old = self.runner.set_pass_limit(request.pass_limit, checked=self.decisions.holds('oom'))
        self._note('pass_limit', {'old': old, 'new': self.runner.pass_limit})

    def _lr(self, request: protocol.BatchRequest) -> None:
        """A new LR schedule, then a new scale; the records that caused an LR change get the old and new LR."""
        old_lr = self.lr.current()
        if request.lr_schedule is not None:
            self.lr.set_schedule(request.lr_schedule)
            self._note('lr_schedule', {'schedule': request.lr_schedule})
        scaled = request.lr_scale is not None and request.lr_scale != self.lr.scale
        old_scale = self.lr.scale
        if scaled:
            self.lr.set_scale(request.lr_scale)
        if not (scaled or request.lr_schedule is not None):
            return
        new_lr = self.lr.current()
        self.decisions.complete(changes_lr, {'old_lr': old_lr, 'new_lr': new_lr}, f'lr {old_lr:.4g} -> {new_lr:.4g}')
        if scaled:
            self._note('lr_scale', {'old': old_scale, 'new': request.lr_scale, 'old_lr': old_lr, 'new_lr': new_lr})

    def _optimizer_scale(self, request: protocol.BatchRequest) -> None:
        """The optimizer's weight decay and beta2; the records that asked get the old and new values."""
        if request.optimizer_scale is None or dict(request.optimizer_scale) == self.optimizer.scale:
            return
        old = self.optimizer.current()
        self.optimizer.set_scale(request.optimizer_scale)
        new = self.optimizer.current()
        values = {'old_weight_decay': old['weight_decay'], 'new_weight_decay': new['weight_decay'],
                  'old_beta2': old['beta2'], 'new_beta2': new['beta2']}
        self.decisions.complete(lambda r: 'optimizer_scale' in r.values, values)
        self._note('optimizer_scale', {'scale': dict(request.optimizer_scale), **values})

