"""One micro-batch as forward/backward passes: splitting, gradient snapshots and norms, the gradient-noise probe."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import protocol
from ..policies.data_plan import piece_bounds
from .input_kinds import InputKind, TextRows, batch_rows
from .padding_free import PackedBatch, split_packed

class GradNoiseProbe:
    """Measures one optimizer step's mean-gradient norms for ``measure_grad_noise`` (no extra passes).

    After the step's first forward/backward pass the accumulated gradient is that pass's alone (this rank's, before
    any reduction); :meth:`finish` reads the whole step's after the engine reduced it across ranks, i.e. the gradient
    the optimizer uses. Under ms-swift's token-sum loss a pass's gradient is ``k * sum of its tokens' gradients``
    with ``k = 1 / num_items_in_batch`` (times the world size when ``average_tokens_across_devices``), so the first
    pass's *mean* gradient is its gradient over ``k * tokens``; the reduced step gradient already is a mean. Cost:
    one sum of squares over the trainable parameters' gradients after the first pass and one after the reduction.
    """

    def __init__(self, samples: int, *, world: int, tokens_averaged: bool, num_items_in_batch: Any) -> None:
        self.samples = samples
        self.world = world
        self.tokens_averaged = tokens_averaged
        self.num_items = num_items_in_batch
        self.passes = 0
        self.small: tuple[float, int] | None = None

    def after_pass(self, model: Any, part: Mapping[str, Any], num_items_in_batch: Any) -> None:
        self.passes += 1
        if self.passes == 1:
            tokens = loss_tokens(part)
            normaliser = float(num_items_in_batch)
            scale = normaliser / (tokens * (self.world if self.tokens_averaged else 1)) if tokens else 0.0
            self.small = (grad_sqnorm(model) * scale * scale, tokens)

    def finish(self, model: Any) -> protocol.GradNoiseSample | None:
        """The step's sample, read from the reduced gradient; ``None`` when the step had a single pass."""
        if self.passes < 2 or self.small is None or self.num_items is None:
            return None
        total_tokens = int(self.num_items) * (1 if self.tokens_averaged or self.world == 1 else self.world)
        return protocol.GradNoiseSample(
            small_sqnorm=self.small[0],
            small_tokens=self.small[1],
            big_sqnorm=grad_sqnorm(model),
            big_tokens=total_tokens,
            samples=self.samples * self.world)


class SampleTooLargeError(RuntimeError):
    """A single sample does not fit in memory even alone: the run stops rather than skip it."""


def batch_shape(inputs: Mapping[str, Any]) -> tuple[int, int]:
    """(rows, padded length) of a collated micro-batch; a packed one (:class:`.attention.PackedBatch`): its rows
    and the longest of them."""
    if isinstance(inputs, PackedBatch):
        return len(inputs.row_lengths), max(inputs.row_lengths, default=0)
    reference = inputs.get('input_ids', inputs.get('labels'))
    if not isinstance(reference, torch.Tensor) or reference.dim() == 0:
        return 1, 0
    return int(reference.shape[0]), int(reference.shape[-1]) if reference.dim() > 1 else 0


def pass_lengths(inputs: Mapping[str, Any]) -> list[int]:
    """The per-row lengths :func:`~..policies.pass_cost.pass_cost` prices a pass by: a packed batch's rows' real
    lengths; a padded batch's padded length for each row (its pieces keep the batch's padding)."""
    if isinstance(inputs, PackedBatch):
        return list(inputs.row_lengths)
    rows, length = batch_shape(inputs)
    return [length] * rows


def row_tokens(batch: Any, row: int) -> int | None:
    if isinstance(batch, PackedBatch):
        return batch.row_lengths[row] if row < len(batch.row_lengths) else None
    mask = batch.get('attention_mask') if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and row < mask.shape[0]:
        return int(mask[row].sum())
    ids = batch.get('input_ids') if isinstance(batch, Mapping) else None
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else None


def frozen_base(model: Any) -> bool:
    """The one snapshot rule of the step paths: where at most a tenth of the parameters train (an adapter run), a copy
    of the trainable gradients is cheap and is taken before a micro-batch, to come back after an OOM; a full
    fine-tune keeps no second copy of its gradients (exactly when memory is short) and runs the step so far again."""
    trainable = total = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable <= 0.1 * max(total, 1)


def grad_snapshot(model: Any) -> list[torch.Tensor | None]:
    """A copy of the trainable parameters' gradients (``None`` where there is none yet)."""
    return [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters() if p.requires_grad]


def restore_grads(model: Any, snapshot: list[torch.Tensor | None]) -> None:
    for p, saved in zip([p for p in model.parameters() if p.requires_grad], snapshot):
        p.grad = saved.clone() if saved is not None else None


def loss_tokens(inputs: Mapping[str, Any]) -> int:
    labels = inputs.get('labels')
    if not isinstance(labels, torch.Tensor):
        raise RuntimeError('measure_grad_noise needs a labels tensor in every micro-batch to count loss tokens')
    return int(labels.ne(-100).sum())


def grad_sqnorm(model: Any) -> float:
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(sum(torch.linalg.vector_norm(g.float())**2 for g in grads))


def split_micro_batch(inputs: Mapping[str, Any], num_pieces: int,
                      kind: InputKind | None = None) -> list[dict[str, Any]]:
    """Split a collated micro-batch into at most ``num_pieces`` contiguous pieces of rows, as even as
    :func:`~..policies.data_plan.piece_bounds` cuts: a packed row at row boundaries
    (:func:`.padding_free.split_packed`), else by its input ``kind`` (:mod:`.input_kinds`; default text rows: each
    tensor sliced along dim 0).

    Raises:
        ValueError: no ``input_ids``/``labels`` tensor gives the batch size, or a key the kind cannot cut (the step
            runner asks :meth:`~.input_kinds.InputKind.refusal` at the step boundary, so a run never gets here).
    """
    if isinstance(inputs, PackedBatch):
        return list(split_packed(inputs, num_pieces))
    bounds = piece_bounds(batch_rows(inputs), num_pieces)
    if len(bounds) <= 1:
        return [dict(inputs)]
    return (kind or TextRows()).cut(inputs, bounds)
