"""Run real ``swift sft`` LoRA trainings on the tiny models and read back what they wrote."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable

MODEL_FLAGS = {
    'qwen2': {'model_type': 'qwen2', 'template': 'qwen2_5'},
    'llama': {'model_type': 'llama', 'template': 'llama', 'system': 'You are a tiny assistant.'},
}


def sft_kwargs(model: str, arch: str, dataset: str, output_dir: str, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model,
        tuner_type='lora',
        torch_dtype='float32',
        dataset=[dataset],
        max_steps=8,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1000,
        check_model=False,
        report_to=['none'],
        add_version=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        dataset_num_proc=1,
        split_dataset_ratio=0.0,
        max_length=1024,
        output_dir=output_dir,
    )
    kwargs.update(MODEL_FLAGS[arch])
    kwargs.update(overrides)
    return kwargs


def run_sft(model: str, arch: str, dataset: str, output_dir: str, *, callbacks: Iterable[str] = (),
            fresh: bool = True, **overrides: Any) -> str:
    """One in-process ``sft_main`` run (in a fresh output dir unless ``fresh=False``); returns the output dir."""
    from swift import SftArguments, sft_main
    if fresh:
        shutil.rmtree(output_dir, ignore_errors=True)
    kwargs = sft_kwargs(model, arch, dataset, output_dir, callbacks=list(callbacks), **overrides)
    sft_main(SftArguments(**kwargs))
    return output_dir


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
