"""The step runner: one optimizer step's micro-batches as forward/backward passes on the engine, with OOM recovery.

HF calls ``training_step`` once per micro-batch; :meth:`StepRunner.run_micro_batch` runs it as one or more passes
(requested pieces, or more to respect the pass limit; the same ``num_items_in_batch``, so the same gradient), lets
a rank without samples join the engine's collectives, recovers from out-of-memory errors and, after the step's last
pass, has the engine reduce the step's gradients. Everything engine-specific is asked of the
:class:`~.engines.base.Engine` adapter chosen at start; nothing here branches on the engine.

State kept for one step only (set by :meth:`StepRunner.start_step` at every step boundary): the micro-batches and
their dataset indices, the pass being run, the OOM retries. ``oom_count`` counts every OOM of the run (it is saved
with the integration's state).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .. import distributed, protocol
from ..loader import EmptyMicroBatch
from ..memory import device_figures, free_memory, is_oom
from ..policies.data_plan import piece_bounds
from ..policies.memory import oom_backoff, pass_cap, pieces_needed
from ..records import DecisionRecord
from .engines import Engine
from .passes import GradNoiseProbe, SampleTooLargeError, batch_shape, grad_snapshot, restore_grads, row_tokens, \
    split_micro_batch

Run = Callable[[Mapping[str, Any]], torch.Tensor]


class StepRunner:
    """Runs the micro-batches of one optimizer step (see the module docstring).

    Args:
        integration: the :class:`~.trainer.Integration` it serves (read: ``trainer``, ``loader.num_pieces``,
            ``pass_limit``, ``check_splittable``; written: ``pass_limit`` after an OOM).
        engine: the engine adapter.
        oom_recovery: whether an OOM is recovered from (the engine allows it and the setting asks for it).
        single_sample_retries: how often a one-sample pass that ran out of memory is run again (memory freed before
            each try) before the sample is declared too large.
    """

    def __init__(self, integration: Any, engine: Engine, *, oom_recovery: bool, single_sample_retries: int) -> None:
        self.integration = integration
        self.engine = engine
        self.oom_recovery = oom_recovery
        self.single_sample_retries = single_sample_retries
        self.oom_count = 0
        self.batches: list[Any] = []
        self.indices: list[list[int]] = []
        self.max_pass = 0  # the largest pass (samples) of the step so far
        self.oom: dict[str, Any] | None = None  # this step's OOM: pass_size, new_cap, record
        self.probe: GradNoiseProbe | None = None
        self._micro = 0
        self._current: tuple[int, int, int] | None = None  # (micro-batch, first row, end row) of the running pass
        self._halvings = 0
        self._single_retries = 0
        self._adapter_like: bool | None = None
        self._template: Mapping[str, Any] | None = None  # the last real micro-batch (placeholder passes copy a row)
        self._checked = False

    @property
    def trainer(self) -> Any:
        return self.integration.trainer

    def start_step(self, pairs: list[tuple[list[int], Any]], probe: GradNoiseProbe | None) -> None:
        """A new optimizer step with ``pairs`` (dataset indices, collated micro-batch)."""
        self.batches = [batch for _, batch in pairs]
        self.indices = [indices for indices, _ in pairs]
        self._micro = self.max_pass = self._halvings = self._single_retries = 0
        self.oom = None
        self.probe = probe

    def clear(self) -> None:
        self.batches, self.indices = [], []

    # ---- one micro-batch ----------------------------------------------------------------------------------
    def run_micro_batch(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any) -> torch.Tensor:
        """Run one HF micro-batch (HF's ``training_step``).

        A placeholder (no sample on this rank) runs what the engine needs to join the other ranks' collectives. A
        real micro-batch runs as one or more passes. With OOM recovery, an out-of-memory error in any pass (forward
        or backward) does not end the run: the step's gradients are dropped (``grad = None``: nothing of the failed
        attempt leaks into the step), memory is freed, the pass cap is halved, and the micro-batch is run again in
        smaller passes — the same samples with the same loss normalisation, so the optimizer step sees the same
        gradient. The gradients the step had before this micro-batch come back from a snapshot taken before it when
        the trainable parameters are a small part of the model (LoRA and other adapters: at most 10 %, so the copy
        is cheap); otherwise the step's earlier micro-batches are run again too (their losses were already counted
        by HF and are not counted again). A one-sample pass that runs out of memory is run again up to
        ``single_sample_retries`` times; then :class:`SampleTooLargeError` stops the run (never a skipped sample).
        """
        if not self._checked:
            self.engine.check_wrapped(model)
            self._checked = True
        index = self._micro
        self._micro += 1
        last_of_step = index == len(self.batches) - 1
        if isinstance(inputs, EmptyMicroBatch):
            loss = self.engine.placeholder_pass(model, run, self._template, sync=last_of_step)
            if last_of_step:
                self._finish_step(model)
            # A plain zero, not ``loss * 0``: the loss over a row whose labels are all ignored can be NaN (a mean
            # over no tokens), and the trainer adds what is returned here to the logged training loss.
            return torch.zeros((), device=loss.device if loss is not None else self.trainer.args.device)
        self._template = inputs
        if not self.oom_recovery:
            loss = self._run_passes(model, inputs, run, num_items_in_batch, index, final=last_of_step)
        else:
            loss = self._run_with_recovery(model, inputs, run, num_items_in_batch, index, last_of_step)
        if last_of_step:
            self._finish_step(model)
        return loss

    def _run_with_recovery(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any, index: int,
                           last_of_step: bool) -> torch.Tensor:
        snapshot = grad_snapshot(model) if self._snapshot_grads(model) else None
        retries = 0
        while True:
            failed: tuple[int, int, int] | None = None
            try:
                if retries and snapshot is not None:  # the step's gradients before this micro-batch, back
                    restore_grads(model, snapshot)
                elif retries:  # the step so far, again: the gradients were dropped
                    for j in range(index):
                        if not isinstance(self.batches[j], EmptyMicroBatch):
                            self._run_passes(model, self.batches[j], run, num_items_in_batch, j, final=False)
                loss = self._run_passes(model, inputs, run, num_items_in_batch, index, final=last_of_step)
            except Exception as error:  # noqa: BLE001 - only OOMs are handled; everything else is re-raised
                if not is_oom(error):
                    raise
                failed = self._current if self._current is not None else (index, 0, 1)
            if failed is None:
                if retries:
                    self._report_oom(retries)
                return loss
            retries += 1
            self._recover(model, failed)

    def _run_passes(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any, index: int, *,
                    final: bool) -> torch.Tensor:
        """One micro-batch as ``pieces`` passes. ``final``: the step's last micro-batch (its last pass syncs)."""
        rows, length = batch_shape(inputs)
        requested = self.integration.loader.num_pieces if self.integration.loader is not None else 1
        pieces = pieces_needed(rows, requested, pass_cap(length, self.integration.effective_pass_limit()))
        probe = self.probe
        if pieces > 1 and num_items_in_batch is None:
            raise RuntimeError('splitting a micro-batch into passes (num_pieces > 1, a pass limit or OOM recovery) '
                               'needs the loss normalised by num_items_in_batch (token-sum losses, as ms-swift uses); '
                               'this model/trainer computes a per-batch mean, so splitting would change the gradient')
        if probe is not None and num_items_in_batch is None:
            raise RuntimeError('measure_grad_noise needs the loss normalised by num_items_in_batch (token-sum '
                               'losses, as ms-swift uses); this model/trainer computes a per-batch mean')
        if pieces > 1:
            self.integration.check_splittable('new_num_pieces / new_pass_limit')
        bounds = piece_bounds(rows, pieces)
        parts = split_micro_batch(inputs, pieces) if pieces > 1 else [inputs]
        total = None
        for i, (part, (start, stop)) in enumerate(zip(parts, bounds)):
            last = i == len(parts) - 1
            self._current = (index, start, stop)
            self.max_pass = max(self.max_pass, stop - start)
            with self.engine.pass_context(model, sync=final and last):
                loss = run(dict(part))
            total = loss if total is None else total + loss
            if probe is not None:
                probe.after_pass(model, part, num_items_in_batch)
        self._current = None
        setattr(self.trainer.control, protocol.PASS_SIZE, self.max_pass)
        return total

    def _finish_step(self, model: Any) -> None:
        """After the step's last pass: the engine's gradient reduction, then the noise probe's step measurement
        (the gradient the optimizer uses, reduced across ranks)."""
        self.engine.finish_step(model)
        if self.probe is not None:
            sample = self.probe.finish(model)
            if sample is not None:
                setattr(self.trainer.control, protocol.GRAD_NOISE_SAMPLE, sample)

    # ---- out of memory -------------------------------------------------------------------------------------
    def _snapshot_grads(self, model: Any) -> bool:
        if self._adapter_like is None:
            trainable = total = 0
            for p in model.parameters():
                total += p.numel()
                trainable += p.numel() if p.requires_grad else 0
            self._adapter_like = trainable <= 0.1 * max(total, 1)
        return self._adapter_like

    def _recover(self, model: Any, failed: tuple[int, int, int]) -> None:
        """After an OOM (outside the ``except`` block, so the traceback no longer pins tensors): drop the step's
        gradients, free memory, let the engine repair its state, then halve the pass (or, for a one-sample pass,
        try it again as it is, a bounded number of times)."""
        micro, start, stop = failed
        size = stop - start
        for p in model.parameters():
            p.grad = None
        self.probe = None  # the first-pass gradient of this step is gone
        free_memory()
        self.engine.after_oom(model)
        self.oom_count += 1
        if size <= 1:
            if self._single_retries < self.single_sample_retries:
                self._single_retries += 1
                cap = (self.integration.pass_limit or {}).get('samples')
                self.oom = {'pass_size': 1, 'new_cap': cap, 'record': None}
                return
            raise self._too_large(micro, start)
        cap = oom_backoff(size)
        self.integration.pass_limit = {**(self.integration.pass_limit or {'tokens': None, 'rules': []}),
                                       'samples': cap}
        self._halvings += 1
        self.oom = {'pass_size': size, 'new_cap': cap, 'record': None}

    def _too_large(self, micro: int, start: int) -> SampleTooLargeError:
        batch = self.batches[micro]
        indices = self.indices[micro] if micro < len(self.indices) else []
        row_ids = batch.get('input_ids') if isinstance(batch, Mapping) else None
        tokens = row_tokens(batch, start)
        padded = int(row_ids.shape[-1]) if isinstance(row_ids, torch.Tensor) else None
        sample = indices[start] if start < len(indices) else None
        return SampleTooLargeError(
            f'out of memory on a single sample (dataset index {sample}, {tokens} tokens, padded to {padded}) after '
            f'{self._halvings} halvings of the pass and {self._single_retries} retries of the one-sample pass '
            f'(memory freed before each; integration.oom_single_sample_retries: {self.single_sample_retries}); '
            f'memory: {device_figures()}. It cannot fit: shorten it (max_length / truncation_strategy), use a smaller '
            'model, gradient checkpointing, or more memory. It was not skipped: skipping would silently lose data.')

    def _report_oom(self, retries: int) -> None:
        info = self.oom or {'pass_size': 0, 'new_cap': None}
        figures = device_figures()
        event = protocol.OomEvent(info['pass_size'], info['new_cap'], retries, figures)
        setattr(self.trainer.control, protocol.OOM_EVENT, event)
        cap = info['new_cap']
        how = (f'at most {cap} a pass' if self._halvings else
               'the same one-sample pass after freeing memory' + (f' (pass cap stays {cap})' if cap else ''))
        # held until the next step boundary, where every rank's OOM records are exchanged (``apply_requests``)
        info['record'] = DecisionRecord(
            'integration', 'oom', 'recovered', {
                'rank': distributed.rank(),
                'pass_size': info['pass_size'],
                'new_pass_cap': cap,
                'retries': retries,
                'single_sample_retries': self._single_retries,
                'oom_count': self.oom_count,
                **{f'memory_{k}': v for k, v in figures.items()}
            }, f'out of memory in a pass of {info["pass_size"]} samples: the step was run again with {how} '
            '(same samples, same gradient)', step=self.trainer.state.global_step)
