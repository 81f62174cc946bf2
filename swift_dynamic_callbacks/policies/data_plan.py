"""How the samples left in an epoch are cut into optimizer steps and micro-batches (pure functions).

One optimizer step per device takes ``entries`` micro-batches (HF's ``gradient_accumulation_steps``) of
``batch_size`` samples. The last step of an epoch takes what is left, spread as evenly as possible over the
``entries`` micro-batches in ascending order, so the last micro-batch (the one that synchronises gradients
under DDP) is never empty while any sample is left. Nothing is dropped: the sizes always add up to the
samples remaining.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence


#: epochs and samples computed from fractions are compared and rounded with this tolerance (floating-point noise:
#: ``0.1 * 30`` is ``3.0000000000000004``, which must still be 3 samples, not 4)
_SCALE = 10**9
TOLERANCE = 1 / _SCALE


def tolerant_ceil(x: float) -> int:
    """``ceil(x)``, except that ``x`` within about :data:`TOLERANCE` above an integer counts as that integer."""
    return -(-round(x * _SCALE) // _SCALE)


def before(progress: float, target: float) -> bool:
    """Whether ``progress`` (epochs) has not reached ``target`` yet, beyond :data:`TOLERANCE`."""
    return progress < target - TOLERANCE


def step_sizes(remaining: int, batch_size: int, entries: int) -> tuple[int, ...]:
    """Micro-batch sizes of the next optimizer step.

    Args:
        remaining: samples of this device's epoch shard not yet used (>= 0).
        batch_size: per-device micro-batch size (>= 1).
        entries: micro-batches per optimizer step (>= 1).

    Returns:
        ``entries`` sizes, each in ``[0, batch_size]``, summing to ``min(remaining, batch_size * entries)``.
        Full steps are ``(batch_size,) * entries``; a short last step is balanced, ascending.
    """
    if remaining < 0 or batch_size < 1 or entries < 1:
        raise ValueError(f'step_sizes: need remaining >= 0, batch_size >= 1, entries >= 1; '
                         f'got {remaining}, {batch_size}, {entries}')
    take = min(remaining, batch_size * entries)
    if take == batch_size * entries:
        return (batch_size, ) * entries
    base, extra = divmod(take, entries)
    return (base, ) * (entries - extra) + (base + 1, ) * extra


def epoch_steps(remaining: int, batch_size: int, entries: int) -> Iterator[tuple[int, ...]]:
    """All steps that finish an epoch with ``remaining`` samples at a constant batch size."""
    while remaining > 0:
        sizes = step_sizes(remaining, batch_size, entries)
        remaining -= sum(sizes)
        yield sizes


def steps_in_epoch(remaining: int, batch_size: int, entries: int) -> int:
    """Number of optimizer steps :func:`epoch_steps` yields: ``ceil(remaining / (batch_size * entries))``."""
    per_step = batch_size * entries
    return -(-remaining // per_step)


def piece_bounds(size: int, num_pieces: int) -> tuple[tuple[int, int], ...]:
    """Split ``size`` rows into at most ``num_pieces`` contiguous, non-empty ``(start, stop)`` ranges.

    Sizes differ by at most one; fewer pieces than asked when ``size < num_pieces``.
    """
    if size < 0 or num_pieces < 1:
        raise ValueError(f'piece_bounds: need size >= 0 and num_pieces >= 1, got {size}, {num_pieces}')
    pieces = min(num_pieces, size)
    bounds = []
    start = 0
    for i in range(pieces):
        stop = start + size // pieces + (1 if i < size % pieces else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def steps_to_budget(epoch: int, position: int, epoch_size: int, budget_epochs: float, batch_size: int,
                    entries: int) -> int:
    """Optimizer steps still needed to use ``budget_epochs`` epochs of data at a constant batch size.

    Training stops once ``epoch + position / epoch_size >= budget_epochs``; each epoch is cut by
    :func:`epoch_steps`. Args are this device's position (``epoch``, ``position`` samples into it).
    """
    if epoch_size < 1:
        raise ValueError(f'steps_to_budget: epoch_size must be >= 1, got {epoch_size}')
    steps = 0
    while before(epoch + position / epoch_size, budget_epochs):
        if position >= epoch_size:
            epoch, position = epoch + 1, 0
            continue
        fraction = min(budget_epochs - epoch, 1.0)
        target = min(epoch_size, tolerant_ceil(fraction * epoch_size))
        per_step = batch_size * entries
        if target < epoch_size:
            steps += -(-(target - position) // per_step)
            break
        steps += steps_in_epoch(epoch_size - position, batch_size, entries)
        epoch, position = epoch + 1, 0
    return steps


def planned_steps_to_budget(epoch: int, position: int, epoch_size: int, budget_epochs: float, entries: int,
                            sizes: Sequence[int], epoch_sizes: Callable[[int], Sequence[int]]) -> int:
    """Optimizer steps still needed to use ``budget_epochs`` epochs of data when epochs are cut into planned
    micro-batches (a batch plan) instead of equal ones (:func:`steps_to_budget`).

    Args:
        epoch, position: this device's position (``position`` samples into ``epoch``; ``position == epoch_size``: the
            epoch is used up).
        epoch_size: samples of an epoch on this device (>= 1).
        budget_epochs: training stops once ``epoch + position / epoch_size`` reaches it.
        entries: micro-batches per optimizer step.
        sizes: the micro-batch sizes planned for the rest of ``epoch`` from ``position``.
        epoch_sizes: ``epoch -> its micro-batch sizes from its start`` (called only for the epochs the budget reaches).

    Each epoch takes ``ceil(micro-batches / entries)`` steps; an epoch the budget ends inside counts the micro-batches
    that reach its share of the epoch (:func:`tolerant_ceil`).
    """
    if epoch_size < 1:
        raise ValueError(f'planned_steps_to_budget: epoch_size must be >= 1, got {epoch_size}')
    steps = 0
    while before(epoch + position / epoch_size, budget_epochs):
        if position >= epoch_size:
            epoch, position, sizes = epoch + 1, 0, epoch_sizes(epoch + 1)
            continue
        target = min(epoch_size, tolerant_ceil(min(budget_epochs - epoch, 1.0) * epoch_size))
        count = micro_batches_to(sizes, target - position)
        steps += -(-count // entries)
        if target < epoch_size:
            break
        position = epoch_size
    return steps


def micro_batches_to(sizes: Sequence[int], samples: int) -> int:
    """How many of the micro-batches ``sizes`` (in drawing order) are drawn until at least ``samples`` samples are."""
    count, taken = 0, 0
    for size in sizes:
        if taken >= samples:
            break
        taken += size
        count += 1
    return count


def redealt_to_draw(budget_epochs: float, epoch: int, dataset_size: int, consumed: int, dealt: int, share: int,
                    done: int) -> int:
    """Samples of this device's share of a re-dealt epoch still to draw to reach ``budget_epochs``.

    The epoch was re-dealt after ``consumed`` of its ``dataset_size`` samples were used: ``dealt`` samples, of which
    this device holds ``share`` and used ``done``. When the budget ends inside the epoch, each device draws its
    proportional part of the samples still needed (rounded up); otherwise its whole share.
    """
    target = share
    if before(budget_epochs, epoch + 1):  # the budget ends inside this epoch
        need = tolerant_ceil((budget_epochs - epoch) * dataset_size) - consumed
        target = min(share, -(-max(need, 0) * share // max(dealt, 1)))
    return max(target - done, 0)


def redeal(rests: list[list[int]], world: int) -> list[list[int]]:
    """Deal the samples a run on ``len(rests)`` processes left in an epoch to ``world`` processes.

    ``rests[q]`` is old rank ``q``'s unconsumed samples, in its order. They are interleaved round-robin (rank 0's
    next, rank 1's next, ...: the order in which the old ranks would have drawn them) and dealt ``rank::world``, so
    every sample left is dealt exactly once and the new shards differ by at most one sample.
    """
    if world < 1:
        raise ValueError(f'redeal: world must be >= 1, got {world}')
    longest = max((len(r) for r in rests), default=0)
    merged = [rest[k] for k in range(longest) for rest in rests if k < len(rest)]
    return [merged[rank::world] for rank in range(world)]


def per_device_batch(global_batch: int, world: int, entries: int) -> tuple[int, bool]:
    """The per-device micro-batch that keeps ``global_batch`` samples a step on ``world`` processes with ``entries``
    micro-batches each; ``(size, exact)``. When it does not divide, the nearest size (at least 1) and ``False``."""
    if global_batch < 1 or world < 1 or entries < 1:
        raise ValueError(f'per_device_batch: need global_batch, world, entries >= 1; got {global_batch}, {world}, '
                         f'{entries}')
    size, left = divmod(global_batch, world * entries)
    if left == 0:
        return size, True
    return max(1, round(global_batch / (world * entries))), False
