"""``task_type: embedding`` (InfoNCE) and ``reranker`` with the pack: their losses compare the rows of a call
(in-batch negatives, a query's documents), so a micro-batch is never cut (OOM recovery off, said in the engine
record), yet every run-level callback works and the run trains to its end. Real ``swift sft`` runs of the tiny Qwen2
on GSM8K questions with their answers as documents (``write_retrieval_dataset``)."""

from __future__ import annotations

import os

import pytest
import torch

from swift_runs import decisions, run_sft, train_logs

pytestmark = pytest.mark.e2e

PACK = {'training_log': {}, 'lr_schedule': {'warmup': 1, 'hold': 0},
        'early_stopping': {'monitor': 'loss', 'patience': 100},
        'checkpoint_rotation': {'keep_last': 1, 'keep_best': 0}}
TASKS = {'embedding': {'task_type': 'embedding', 'loss_type': 'infonce'}, 'reranker': {'task_type': 'reranker'}}


@pytest.fixture(scope='module')
def retrieval_rows(tmp_path_factory):
    from swift_dynamic_callbacks.testing.tiny import write_retrieval_dataset
    return str(write_retrieval_dataset(tmp_path_factory.mktemp('retrieval') / 'rows.jsonl', 16))


def _run(tiny_qwen, rows, out, task, **extra):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(**PACK)
        return run_sft(tiny_qwen, 'qwen2', rows, out, callbacks=list(PACK), max_steps=4, save_steps=2,
                       per_device_train_batch_size=2, **TASKS[task], **extra)
    finally:
        plugin.unregister()


@pytest.mark.parametrize('task', list(TASKS))
def test_a_retrieval_run_trains_to_its_end_with_every_run_level_callback(tiny_qwen, retrieval_rows, tmp_path, task):
    """4 steps with ``training_log``, ``lr_schedule``, ``early_stopping`` and ``checkpoint_rotation``: the LR is the
    pack's warmup then cosine, the last checkpoint alone is kept (the other deleted by the pack), the training log is
    written, and the engine record says why OOM recovery is off (the task's loss compares rows)."""
    out = _run(tiny_qwen, retrieval_rows, str(tmp_path / task), task)
    logs = train_logs(out)
    assert len(logs) == 4 and all(row['loss'] == row['loss'] for row in logs)  # finite, every step
    assert [row['learning_rate'] for row in logs][:2] == pytest.approx([0.0, 1e-3])
    assert all('dynamic/lr_scale' in row for row in logs)
    records = decisions(out)
    [engine] = [d for d in records if d['kind'] == 'engine']
    assert engine['values']['oom_recovery'] is False
    assert TASKS[task].get('loss_type', task) in engine['values']['oom_recovery_off']
    assert [d['values']['checkpoint'] for d in records if d['kind'] == 'delete_checkpoint'] == ['checkpoint-2']
    assert sorted(n for n in os.listdir(out) if n.startswith('checkpoint-')) == ['checkpoint-4']
    assert os.path.getsize(os.path.join(out, 'dynamic_training_log.jsonl')) > 0


def test_an_oom_in_an_embedding_run_ends_it_with_the_packs_message(tiny_qwen, retrieval_rows, tmp_path, caplog):
    """An OOM injected in step 2's forward: recovery is off for InfoNCE, so the run ends with the OOM, after the pack
    said which pass, that recovery is off and why, and left its note for a resumed run (never a ValueError of a cut
    it may not make)."""
    from swift_dynamic_callbacks.testing.faults import OomInjector
    out = str(tmp_path / 'oom')
    with OomInjector(forward_passes=(3, )), caplog.at_level('ERROR', logger='swift_dynamic_callbacks'), \
            pytest.raises(torch.OutOfMemoryError):
        _run(tiny_qwen, retrieval_rows, out, 'embedding')
    [message] = [r.getMessage() for r in caplog.records if 'out of memory on rank 0' in r.getMessage()]
    assert 'loss_type: infonce' in message
    assert os.path.exists(os.path.join(out, 'dynamic_oom.rank0.json'))
