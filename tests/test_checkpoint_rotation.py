"""Checkpoint rotation: the pure selection, the on_save hook on real directories, and real swift sft runs."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import TrainerControl, TrainerState, TrainingArguments

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.checkpoint_rotation import (CheckpointRotationCallback,
                                                                   CheckpointRotationConfig, checkpoint_metric)
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.policies.rotation import checkpoint_step, select_for_deletion
from swift_dynamic_callbacks.state import read_state
from swift_runs import decisions, read_jsonl, run_sft

# ---- the pure selection ---------------------------------------------------------------------------------


def names(*steps):
    return [f'checkpoint-{s}' for s in steps]


def test_selection_table():
    ckpts = names(10, 2, 4, 6, 8)  # ordered by the step in the name, not as listed
    assert select_for_deletion(ckpts, keep_last=2) == names(2, 4, 6)
    assert select_for_deletion(ckpts, keep_last=1, keep_best=1, metrics={'checkpoint-4': 0.5, 'checkpoint-8': 0.7}) \
        == names(2, 6, 8)
    assert select_for_deletion(ckpts, keep_last=1, keep_best=1, mode='max',
                               metrics={'checkpoint-4': 0.5, 'checkpoint-8': 0.7}) == names(2, 4, 6)
    assert select_for_deletion(ckpts, keep_last=1, keep_best=2, metrics={4: 0.5, 6: float('nan'), 8: 0.7}) == \
        names(2, 6)  # metrics by step; a NaN is never best
    assert select_for_deletion(ckpts, keep_last=1, protected=['out/checkpoint-2', 6]) == names(4, 8)
    assert select_for_deletion(['a/checkpoint-3', 'a/checkpoint-1', 'a/best'], keep_last=1) == ['a/checkpoint-1']
    assert select_for_deletion([5, 1, 3], keep_last=0) == [1, 3]  # the newest is kept whatever keep_last says
    assert select_for_deletion([], keep_last=1) == []
    assert checkpoint_step('out/checkpoint-12/') == 12 and checkpoint_step('checkpoint-x') is None
    with pytest.raises(ValueError, match='mode'):
        select_for_deletion(ckpts, keep_last=1, mode='best')


steps_st = st.lists(st.integers(0, 60), max_size=25, unique=True)


@given(steps=steps_st, extra=st.lists(st.sampled_from(['best', 'last-checkpoint', 'runs', 'checkpoint-x']),
                                      max_size=3),
       keep_last=st.integers(-1, 6), keep_best=st.integers(0, 4),
       scores=st.dictionaries(st.integers(0, 60), st.floats(allow_nan=True, allow_infinity=True), max_size=25),
       protected=st.lists(st.one_of(st.integers(0, 60), st.sampled_from(['best', 'checkpoint-7'])), max_size=5),
       mode=st.sampled_from(['min', 'max']), as_paths=st.booleans(), shuffle=st.randoms())
def test_protected_newest_and_best_are_never_selected(steps, extra, keep_last, keep_best, scores, protected, mode,
                                                      as_paths, shuffle):
    ckpts = [f'out/checkpoint-{s}' if as_paths else f'checkpoint-{s}' for s in steps] + extra
    shuffle.shuffle(ckpts)
    metrics = {f'checkpoint-{s}': v for s, v in scores.items()}
    selected = select_for_deletion(ckpts, keep_last=keep_last, keep_best=keep_best, metrics=metrics, mode=mode,
                                   protected=protected)
    sel_steps = [checkpoint_step(c) for c in selected]
    assert set(selected) <= set(ckpts) and None not in sel_steps  # only checkpoint-<N> of the input
    assert sel_steps == sorted(sel_steps)  # oldest first
    protected_steps = {checkpoint_step(p) for p in protected}
    assert not protected_steps & set(sel_steps)
    ordered = sorted(steps)
    assert not set(ordered[-max(keep_last, 1):]) & set(sel_steps)  # the newest keep_last (at least 1)
    finite = {s: v for s, v in scores.items() if s in steps and v == v and abs(v) != float('inf')}
    sign = 1 if mode == 'min' else -1
    best = sorted(finite, key=lambda s: (sign * finite[s], -s))[:keep_best]
    assert not set(best) & set(sel_steps)
    kept = len(steps) - len(selected)
    assert kept == len(set(ordered[-max(keep_last, 1):]) | set(best) | (protected_steps & set(steps)))
    # the same answer whatever order the directory listing came in
    assert select_for_deletion(sorted(ckpts), keep_last=keep_last, keep_best=keep_best, metrics=metrics, mode=mode,
                               protected=protected) == selected


# ---- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize('settings,field', [
    ({'keep_last': 0}, 'keep_last'),
    ({'keep_last': 1.5}, 'keep_last'),
    ({'keep_best': -1}, 'keep_best'),
    ({'metric': ''}, 'metric'),
    ({'mode': 'lowest'}, 'mode'),
])
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ConfigError) as e:
        CheckpointRotationConfig(**settings)
    assert str(e.value).startswith(f'{field}:'), str(e.value)


def test_save_total_limit_is_refused_at_train_begin(tmp_path):
    cb = CheckpointRotationCallback(CheckpointRotationConfig(keep_last=2))
    args = TrainingArguments(output_dir=str(tmp_path), save_total_limit=3, report_to=[])
    with pytest.raises(ConfigError, match=r'save_total_limit: .* got 3; use dynamic_callbacks.checkpoint_rotation.'
                       r'keep_last'):
        cb.on_train_begin(args, TrainerState(), TrainerControl())
    cb.on_train_begin(TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerState(), TrainerControl())


# ---- on_save on real directories --------------------------------------------------------------------------


def make_checkpoint(out, step, eval_loss=None, complete=True):
    path = os.path.join(out, f'checkpoint-{step}')
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'adapter_model.safetensors'), 'w') as f:
        f.write('x')
    if complete:
        history = [{'loss': 1.0, 'step': step}]
        if eval_loss is not None:
            history.append({'eval_loss': eval_loss, 'step': step})
        with open(os.path.join(path, 'trainer_state.json'), 'w') as f:
            json.dump({'global_step': step, 'log_history': history}, f)
    return path


def save_event(cb, out, step, control=None, **args_kw):
    control = control or TrainerControl()
    args = TrainingArguments(output_dir=str(out), report_to=[], **args_kw)
    cb.on_save(args, TrainerState(global_step=step), control)
    return control


def listing(out):
    return sorted((n for n in os.listdir(out) if n.startswith('checkpoint-')), key=checkpoint_step)


def test_on_save_keeps_last_and_best_and_records_each_deletion(tmp_path):
    out = str(tmp_path)
    for step, loss in [(2, 3.0), (4, 1.0), (6, None), (8, 2.0), (10, 2.5)]:
        make_checkpoint(out, step, loss)
    cb = CheckpointRotationCallback(CheckpointRotationConfig(keep_last=2, keep_best=1))
    control = save_event(cb, out, 10)
    assert listing(out) == names(4, 8, 10)
    records = protocol.drain_decisions(control)
    assert [(r.kind, r.values['checkpoint'], r.values['value'], r.step) for r in records] == [
        ('delete_checkpoint', 'checkpoint-2', 3.0, 10), ('delete_checkpoint', 'checkpoint-6', None, 10)]
    assert records[0].values['kept'] == names(4, 8, 10)


def test_incomplete_checkpoints_are_neither_counted_nor_deleted(tmp_path):
    out = str(tmp_path)
    make_checkpoint(out, 2, 1.0)
    make_checkpoint(out, 4, 2.0)
    make_checkpoint(out, 6, complete=False)  # a save that crashed
    cb = CheckpointRotationCallback(CheckpointRotationConfig(keep_last=1, keep_best=0))
    # the checkpoint "just saved" is incomplete: nothing is deleted, the older ones stay loadable
    assert protocol.drain_decisions(save_event(cb, out, 6)) == []
    assert listing(out) == names(2, 4, 6)
    make_checkpoint(out, 8, 1.5)
    save_event(cb, out, 8)
    assert listing(out) == names(6, 8)  # checkpoint-6 is not this callback's to judge
    with open(os.path.join(out, 'checkpoint-8', 'trainer_state.json'), 'w') as f:
        f.write('{"global_st')  # torn file
    assert protocol.drain_decisions(save_event(cb, out, 8)) == []


def test_resume_checkpoint_link_target_and_hf_best_are_protected(tmp_path):
    out = str(tmp_path)
    for step in (2, 4, 6, 8, 10):
        make_checkpoint(out, step)
    os.symlink('checkpoint-4', os.path.join(out, 'last-checkpoint'))  # as ms-swift writes it (relative)
    os.symlink(os.path.join(out, 'checkpoint-6'), os.path.join(out, 'checkpoint-99'))  # a link: never touched
    cb = CheckpointRotationCallback(CheckpointRotationConfig(keep_last=1, keep_best=0))
    args = TrainingArguments(output_dir=out, report_to=[], resume_from_checkpoint=os.path.join(out, 'checkpoint-2'))
    state = TrainerState(global_step=10, best_model_checkpoint=os.path.join(out, 'checkpoint-8'))
    cb.on_save(args, state, TrainerControl())
    assert listing(out) == names(2, 4, 8, 10, 99)
    assert not os.path.exists(os.path.join(out, 'checkpoint-6'))  # only checkpoint-6 was free to go
    assert os.path.islink(os.path.join(out, 'checkpoint-99'))


def test_resume_checkpoint_of_another_directory_protects_nothing_here(tmp_path):
    out = str(tmp_path / 'run')
    for step in (2, 4):
        make_checkpoint(out, step)
    cb = CheckpointRotationCallback(CheckpointRotationConfig(keep_last=1))
    save_event(cb, out, 4, resume_from_checkpoint=str(tmp_path / 'other' / 'checkpoint-2'))
    assert listing(out) == names(4)


def test_only_rank_0_deletes(tmp_path, monkeypatch):
    from swift_dynamic_callbacks import distributed
    monkeypatch.setattr(distributed, 'is_main_process', lambda: False)
    out = str(tmp_path)
    for step in (2, 4):
        make_checkpoint(out, step)
    save_event(CheckpointRotationCallback(CheckpointRotationConfig(keep_last=1)), out, 4)
    assert listing(out) == names(2, 4)


def test_metric_lookup_in_log_history():
    state = {'log_history': [{'loss': 2.0, 'step': 4}, {'eval_loss': 1.5, 'step': 4}, {'eval_loss': 1.2, 'step': 6}]}
    assert checkpoint_metric(state, 4, 'eval_loss') == 1.5
    assert checkpoint_metric(state, 4, 'loss') == 2.0
    assert checkpoint_metric({'log_history': [{'eval_acc': 0.5, 'step': 4}]}, 4, 'acc') == 0.5  # HF's fallback
    assert checkpoint_metric(state, 5, 'eval_loss') is None  # nothing logged at that step
    assert checkpoint_metric({'log_history': [{'eval_loss': float('nan'), 'step': 4}]}, 4, 'eval_loss') is None


def test_a_non_finite_step_is_never_the_best_checkpoint():
    """Measured: metric loss, min: the NaN step's checkpoint (loss logged as 0.0 by HF's nan filter) was kept as the
    best and older good ones were deleted. The integration marks such a line with dynamic/nonfinite_steps."""
    marked = {'log_history': [{'loss': 0.0, 'dynamic/nonfinite_steps': 1, 'step': 4}]}
    assert checkpoint_metric(marked, 4, 'loss') is None
    assert checkpoint_metric({'log_history': [{'loss': 0.5, 'dynamic/nonfinite_steps': 0, 'step': 4}]}, 4,
                             'loss') == 0.5
    assert checkpoint_metric({'log_history': [{'loss': float('inf'), 'step': 4}]}, 4, 'loss') is None
    assert checkpoint_metric({'log_history': [{'loss': 'nan', 'step': 4}]}, 4, 'loss') is None


def test_on_save_keeps_the_best_finite_checkpoint_not_the_nan_one(tmp_path):
    out = str(tmp_path)
    for step, loss, nonfinite in [(2, 3.0, 0), (4, 1.0, 0), (6, 0.0, 1), (8, float('nan'), 0), (10, 2.0, 0)]:
        path = make_checkpoint(out, step)
        with open(os.path.join(path, 'trainer_state.json'), 'w') as f:  # NaN as json writes it (allow_nan)
            json.dump({'global_step': step, 'log_history': [{'loss': loss, 'dynamic/nonfinite_steps': nonfinite,
                                                             'step': step}]}, f)
    cb = CheckpointRotationCallback(CheckpointRotationConfig(keep_last=1, keep_best=1, metric='loss'))
    save_event(cb, out, 10)
    assert listing(out) == names(4, 10)  # the best finite (step 4) and the newest; not 6 (0.0 for a NaN) nor 8


# ---- real swift sft runs ----------------------------------------------------------------------------------

BASE = dict(callbacks=['checkpoint_rotation'], lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=2)
RUN = dict(BASE, split_dataset_ratio=0.125, per_device_eval_batch_size=2, eval_steps=4,
           metric_for_best_model='loss', greater_is_better=True)  # HF's best = ours, so HF's protection adds nothing
ROTATION = {'keep_last': 1, 'keep_best': 1, 'metric': 'eval_loss', 'mode': 'max'}


def eval_losses(out):
    return {row['global_step/max_steps'].split('/')[0]: row['eval_loss']
            for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'eval_loss' in row}


def deleted(out):
    return [d['values']['checkpoint'] for d in decisions(out) if d['kind'] == 'delete_checkpoint']


@pytest.mark.e2e
def test_rotation_with_save_steps_not_eval_steps_then_resume(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(checkpoint_rotation=ROTATION)
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'rot'), max_steps=8, **RUN)
        losses = eval_losses(out)
        assert sorted(losses, key=int) == ['4', '8']  # saved at 2, 4, 6, 8; evaluated at 4 and 8 only
        best = max(('4', '8'), key=lambda s: (losses[s], int(s)))
        # step 4 deletes 2 (newest 4, best 4); step 6 keeps 4 (best) and 6 (newest); step 8 deletes 6 and the
        # loser of 4 vs 8
        assert listing(out) == sorted({f'checkpoint-{best}', 'checkpoint-8'}, key=checkpoint_step)
        assert deleted(out) == ['checkpoint-2', 'checkpoint-6'] + (['checkpoint-4'] if best == '8' else [])
        assert os.readlink(os.path.join(out, 'last-checkpoint')) == 'checkpoint-8'
        # a kept checkpoint holds everything a resume needs, the pack's state and configuration included
        files = set(os.listdir(os.path.join(out, 'checkpoint-8')))
        assert {'adapter_model.safetensors', 'optimizer.pt', 'scheduler.pt', 'rng_state.pth', 'trainer_state.json',
                'dynamic_callbacks_state.json'} <= files
        pack_state = read_state(os.path.join(out, 'checkpoint-8'))
        assert pack_state['config']['checkpoint_rotation'] == ROTATION and 'checkpoint_rotation' in pack_state[
            'components']
        # resume from the rotated run: checkpoint-8 is protected while the run that resumed from it goes on
        run_sft(tiny_llama, 'llama', gsm8k_16, out, fresh=False, max_steps=12,
                resume_from_checkpoint=os.path.join(out, 'checkpoint-8'), **RUN)
        losses = eval_losses(out)
        scored = {s: losses[s] for s in {best, '8', '12'}}
        new_best = max(scored, key=lambda s: (scored[s], int(s)))
        assert read_jsonl(os.path.join(out, 'logging.jsonl'))[-1]['global_step'] == 12
        assert listing(out) == sorted({f'checkpoint-{new_best}', 'checkpoint-8', 'checkpoint-12'},
                                      key=checkpoint_step)
        assert 'checkpoint-10' in deleted(out)
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_a_crash_during_save_leaves_a_loadable_checkpoint(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    import transformers
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    original = transformers.Trainer._save_rng_state

    def crash_at_6(self, output_dir):  # after the weights and optimizer, before trainer_state.json
        if output_dir.endswith('checkpoint-6'):
            raise RuntimeError('simulated crash during save')
        return original(self, output_dir)

    run = BASE  # no evaluation
    try:
        sdc.register(checkpoint_rotation={'keep_last': 1, 'keep_best': 0})
        out = str(tmp_path / 'crash')
        monkeypatch.setattr(transformers.Trainer, '_save_rng_state', crash_at_6)
        with pytest.raises(RuntimeError, match='simulated crash'):
            run_sft(tiny_llama, 'llama', gsm8k_16, out, max_steps=8, **run)
        monkeypatch.undo()
        assert listing(out) == names(4, 6)
        assert not os.path.exists(os.path.join(out, 'checkpoint-6', 'trainer_state.json'))
        assert os.readlink(os.path.join(out, 'last-checkpoint')) == 'checkpoint-4'
        run_sft(tiny_llama, 'llama', gsm8k_16, out, fresh=False, max_steps=8,
                resume_from_checkpoint=os.path.join(out, 'checkpoint-4'), **run)
        assert read_jsonl(os.path.join(out, 'logging.jsonl'))[-1]['global_step'] == 8
        # checkpoint-4 is what this run resumed from; the rewritten checkpoint-6 went at step 8
        assert listing(out) == names(4, 8)
    finally:
        plugin.unregister()
