"""Run real ``swift sft`` LoRA trainings on the tiny models and read back what they wrote."""

from __future__ import annotations

import json
import os
import shutil
import socket
from typing import Any, Iterable

from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs


def sft_kwargs(model: str, arch: str, dataset: str, output_dir: str, **overrides: Any) -> dict[str, Any]:
    """``offline_sft_kwargs`` with gradient checkpointing off unless a test asks for it: ms-swift turns it on by
    default, and on the tiny models it only re-runs every layer's forward in backward (a fifth of a step). The runs
    that keep it on (ms-swift's default): the injected-OOM runs (``test_memory_backoff.py``) and the LLaMA variant of
    ``test_batch_changes_exactly_once``."""
    return offline_sft_kwargs(model, dataset, output_dir, arch=arch,
                              **{'gradient_checkpointing': False, **overrides})


def run_sft(model: str, arch: str, dataset: str, output_dir: str, *, callbacks: Iterable[str] = (),
            fresh: bool = True, **overrides: Any) -> str:
    """One in-process ``sft_main`` run (in a fresh output dir unless ``fresh=False``); returns the output dir."""
    from swift import SftArguments, sft_main
    if fresh:
        shutil.rmtree(output_dir, ignore_errors=True)
    kwargs = sft_kwargs(model, arch, dataset, output_dir, callbacks=list(callbacks), **overrides)
    sft_main(SftArguments(**kwargs))
    return output_dir


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous: tests may run side by side under pytest-xdist)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


def train_logs(output_dir: str) -> list[dict[str, Any]]:
    """The per-step training lines of ``logging.jsonl`` (those with a loss)."""
    return [row for row in read_jsonl(os.path.join(output_dir, 'logging.jsonl')) if 'loss' in row]


def sample_trace(output_dir: str, rank: int = 0) -> list[dict[str, Any]]:
    return read_jsonl(os.path.join(output_dir, f'dynamic_samples.rank{rank}.jsonl'))


def decisions(output_dir: str) -> list[dict[str, Any]]:
    return read_jsonl(os.path.join(output_dir, 'dynamic_decisions.jsonl'))


def indices_by_epoch(trace: list[dict[str, Any]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row in trace:
        for batch in row['batches']:
            out.setdefault(row['epoch'], []).extend(batch)
    return out
