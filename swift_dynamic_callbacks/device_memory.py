"""Device memory probes and OOM helpers (torch only; no trainer code).

A probe reads the memory of the device a process trains on: :class:`CudaProbe` (allocated / reserved / peak
against the device total), :class:`MpsProbe` / :class:`XpuProbe` where torch exposes them, and
:class:`CpuProbe` (process RSS against a configured budget). :func:`auto_probe` picks one.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Protocol

import torch

GIB = 1024**3


@dataclass(frozen=True)
class MemorySample:
    """One reading, in bytes. ``peak`` is the highest use since the last :meth:`MemoryProbe.reset_peak`;
    ``total`` what the fraction is taken against (``0``: unknown, no fraction)."""

    device: str
    used: int
    reserved: int
    peak: int
    total: int

    @property
    def fraction(self) -> float:
        return self.peak / self.total if self.total > 0 else 0.0

    def figures(self) -> dict[str, float]:
        """GiB figures for records and logs."""
        return {
            'device': self.device,
            'used_gib': round(self.used / GIB, 4),
            'reserved_gib': round(self.reserved / GIB, 4),
            'peak_gib': round(self.peak / GIB, 4),
            'total_gib': round(self.total / GIB, 4),
            'fraction': round(self.fraction, 4),
        }


class MemoryProbe(Protocol):
    name: str

    def read(self) -> MemorySample:
        ...

    def reset_peak(self) -> None:
        ...


class CudaProbe:
    name = 'cuda'

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else device

    def read(self) -> MemorySample:
        total = torch.cuda.get_device_properties(self.device).total_memory
        return MemorySample(f'cuda:{self.device}', torch.cuda.memory_allocated(self.device),
                            torch.cuda.memory_reserved(self.device), torch.cuda.max_memory_allocated(self.device),
                            total)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class XpuProbe:
    name = 'xpu'

    def read(self) -> MemorySample:
        total = torch.xpu.get_device_properties(torch.xpu.current_device()).total_memory
        return MemorySample('xpu', torch.xpu.memory_allocated(), torch.xpu.memory_reserved(),
                            torch.xpu.max_memory_allocated(), total)

    def reset_peak(self) -> None:
        torch.xpu.reset_peak_memory_stats()


class MpsProbe:
    """Apple MPS: no peak counter, so the peak is the current allocation at the end of the step."""

    name = 'mps'

    def read(self) -> MemorySample:
        used = torch.mps.current_allocated_memory()
        return MemorySample('mps', used, torch.mps.driver_allocated_memory(), used,
                            torch.mps.recommended_max_memory())

    def reset_peak(self) -> None:
        pass


def _rss_bytes() -> int:
    try:
        with open('/proc/self/statm', encoding='ascii') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CpuProbe:
    """Process RSS against ``budget_bytes`` (0: no budget, so no fraction). The peak is the RSS at reading time."""

    name = 'cpu'

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget = budget_bytes

    def read(self) -> MemorySample:
        rss = _rss_bytes()
        return MemorySample('cpu', rss, rss, rss, self.budget)

    def reset_peak(self) -> None:
        pass


def auto_probe(cpu_budget_bytes: int = 0) -> MemoryProbe:
    """CUDA, then XPU, then MPS where available; otherwise the CPU probe with ``cpu_budget_bytes``."""
    if torch.cuda.is_available():
        return CudaProbe()
    if hasattr(torch, 'xpu') and torch.xpu.is_available():
        return XpuProbe()
    if torch.backends.mps.is_available():
        return MpsProbe()
    return CpuProbe(cpu_budget_bytes)


_OOM_MESSAGES = ('out of memory', "can't allocate memory", 'not enough memory', 'cudnn_status_alloc_failed',
                 'cublas_status_alloc_failed')


def is_oom(error: BaseException) -> bool:
    """A typed ``torch.OutOfMemoryError`` first; the allocator messages of cuDNN, cuBLAS and CPU as a fallback. An
    error of torch's compiler (dynamo, inductor: a failed compile or autotune whose text may say "out of memory") is
    never taken for an OOM: halving passes would not cure it (a switched attention kernel falls back instead)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if type(error).__module__.startswith(('torch._dynamo', 'torch._inductor')):
        return False
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _OOM_MESSAGES)


def free_memory() -> None:
    """Release what can be released after an OOM (call it outside the ``except`` block: the traceback pins the
    failed step's tensors)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, 'xpu') and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def device_figures() -> dict[str, float]:
    """Memory figures of this process's device for an error message or a record (never raises)."""
    try:
        return auto_probe().read().figures()
    except Exception as e:  # noqa: BLE001 - figures are best effort in an error path
        return {'device': 'unknown', 'error': repr(e)}
