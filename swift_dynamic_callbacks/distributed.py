"""Cross-rank agreement helpers, with a no-op fallback when no process group exists.

Every pack decision that changes what the ranks do goes through one of these before it takes effect, so no
rank shrinks its batch while another waits in an all-reduce. Callbacks never make their own collective calls.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

T = TypeVar('T')


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def is_main_process() -> bool:
    return rank() == 0


# ---- the data-parallel group ---------------------------------------------------------------------------------------
# Under sequence parallelism (ms-swift's ``sequence_parallel_size: N``) the N ranks of a group split every row between
# them: they train on the same samples, so the data is dealt over the data-parallel ranks, not over all ranks.
_DATA: tuple[int, int, int] | None = None  # (data rank, data-parallel size, sequence-parallel size)


def set_sequence_parallel(data_rank: int, data_world: int, sp_size: int) -> None:
    """Deal the data over ``data_world`` data ranks (this rank: ``data_rank``), ``sp_size`` ranks to a group that
    share their samples; ``sp_size`` 1 (or :func:`clear_sequence_parallel`): every rank is its own data rank."""
    global _DATA
    _DATA = (int(data_rank), int(data_world), int(sp_size)) if sp_size > 1 else None


def clear_sequence_parallel() -> None:
    set_sequence_parallel(0, 1, 1)


def data_rank() -> int:
    """This rank's data rank: the shard of the data it trains on (its sequence-parallel group's)."""
    return _DATA[0] if _DATA else rank()


def data_world() -> int:
    """Data ranks: the ranks that train on different samples (all ranks without sequence parallelism)."""
    return _DATA[1] if _DATA else world_size()


def sequence_parallel_size() -> int:
    """Ranks a group that split each row (1: none)."""
    return _DATA[2] if _DATA else 1


def first_of_group() -> bool:
    """Whether this rank speaks for its sequence-parallel group in sums over the data (the group's first rank)."""
    return _DATA is None or rank() % _DATA[2] == 0


def gather_data_objects(value: T) -> list[T]:
    """Every data rank's ``value`` (its sequence-parallel group's first rank's), in data-rank order. Collective."""
    if _DATA is None:
        return gather_objects(value)
    return [v for v, first in gather_objects((value, first_of_group())) if first]


def sum_data_ints(values: Sequence[int]) -> list[int]:
    """Element-wise sums over the data ranks: each sequence-parallel group counted once (its ranks hold the same
    samples). Collective (every rank calls it)."""
    return sum_ints([int(v) if first_of_group() else 0 for v in values])


def gather_objects(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def sum_ints(values: Sequence[int]) -> list[int]:
    """Element-wise sums of ``values`` over ranks, in one small tensor all-reduce (cheaper than gathering objects,
    which pickles and runs two collectives). ``values`` itself without a process group."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [int(v) for v in values]
    import torch
    device = torch.device('cpu')
    if dist.get_backend() == 'nccl':
        device = torch.device('cuda', torch.cuda.current_device())
    tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def max_ints(values: Sequence[int]) -> list[int]:
    """Element-wise maxima of ``values`` over ranks, in one small tensor all-reduce (:func:`sum_ints`'s twin)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [int(v) for v in values]
    import torch
    device = torch.device('cpu')
    if dist.get_backend() == 'nccl':
        device = torch.device('cuda', torch.cuda.current_device())
    tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def broadcast_from_main(value: T) -> T:
    """Rank 0's ``value`` on every rank."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on at least one rank."""
    return any(gather_objects(bool(flag)))


def all_ranks(flag: bool) -> bool:
    """True on every rank only when it is True on all ranks."""
    return all(gather_objects(bool(flag)))


def agree(value: T, merge: Callable[[Sequence[T]], T]) -> T:
    """Gather every rank's ``value`` and return ``merge(values)``, the same on every rank."""
    return merge(gather_objects(value))
