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
