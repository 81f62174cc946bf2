"""Resume integrity: a checkpoint's pack state is bound to that checkpoint (run, step, file digest, dataset), a state
that does not belong is refused, and changed settings are refused unless ``allow_config_change`` (then recorded).

Measured before: a ``dynamic_callbacks_state.json`` from another step or another run copied into a checkpoint resumed
with exit 0 and up to 21 samples of the epoch never trained (or 6 trained twice); a changed growth interval applied
silently from the resumed step.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.snapshot import settings_changes
from swift_dynamic_callbacks.integrations import swift as plugin
from swift_dynamic_callbacks.state import (BINDING_KEY, STATE_FILE, StateError, build_payload, check_binding,
                                           file_digest, read_state, restore_components, write_state)
from swift_runs import decisions, run_sft

GROWTH = {'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4}
RUN = dict(max_steps=8, save_steps=4, lr_scheduler_type='constant', gradient_accumulation_steps=1)


# ---- pure parts ----------------------------------------------------------------------------------------------------
def _checkpoint(path, step: int, run_id: str = 'run-a', entry: bool = True, digest: str | None = None) -> dict:
    payload = build_payload([], {}, binding={'run_id': run_id, 'global_step': step, 'samples_seen': 3 * step},
                            settings={})
    state = write_state(path, payload)
    hf = {'global_step': step, 'stateful_callbacks': {}}
    if entry:
        hf['stateful_callbacks'][BINDING_KEY] = {'args': {}, 'attributes': {
            'run_id': run_id, 'global_step': step, 'state_sha256': digest or file_digest(state)}}
    (path / 'trainer_state.json').write_text(json.dumps(hf))
    return payload


def test_a_state_is_bound_to_its_checkpoint(tmp_path):
    payload = _checkpoint(tmp_path / 'checkpoint-8', 8)
    assert check_binding(tmp_path / 'checkpoint-8', payload)['run_id'] == 'run-a'
    # another step's state file copied in
    _checkpoint(tmp_path / 'checkpoint-4', 4)
    shutil.copy(tmp_path / 'checkpoint-4' / STATE_FILE, tmp_path / 'checkpoint-8' / STATE_FILE)
    copied = json.loads((tmp_path / 'checkpoint-8' / STATE_FILE).read_text())
    with pytest.raises(StateError, match=r"global_step: state file 4, checkpoint 8.*skip or repeat samples"):
        check_binding(tmp_path / 'checkpoint-8', copied)
    # another run's file of the same step
    other = _checkpoint(tmp_path / 'other' / 'checkpoint-8', 8, run_id='run-b')
    shutil.copy(tmp_path / 'other' / 'checkpoint-8' / STATE_FILE, tmp_path / 'checkpoint-8' / STATE_FILE)
    _write_hf(tmp_path / 'checkpoint-8', 8, 'run-a', 'x' * 64)
    with pytest.raises(StateError, match=r"run_id: state file 'run-b', checkpoint 'run-a'"):
        check_binding(tmp_path / 'checkpoint-8', other)
    # an edited file (same run and step, other bytes)
    _checkpoint(tmp_path / 'checkpoint-9', 9, digest='0' * 64)
    with pytest.raises(StateError, match='state_sha256'):
        check_binding(tmp_path / 'checkpoint-9', json.loads((tmp_path / 'checkpoint-9' / STATE_FILE).read_text()))
    # a checkpoint written without the pack's entry (the file was copied into a plain checkpoint)
    plain = _checkpoint(tmp_path / 'checkpoint-3', 3, entry=False)
    with pytest.raises(StateError, match=f'has no {BINDING_KEY} entry'):
        check_binding(tmp_path / 'checkpoint-3', plain)
    # a format 1 file (an earlier version) is read, unbound
    assert check_binding(tmp_path / 'checkpoint-3', {'format': 1, 'components': {}}) is None


def _write_hf(path, step: int, run_id: str, digest: str) -> None:
    (path / 'trainer_state.json').write_text(json.dumps({'global_step': step, 'stateful_callbacks': {BINDING_KEY: {
        'args': {}, 'attributes': {'run_id': run_id, 'global_step': step, 'state_sha256': digest}}}}))


def test_settings_changes_lists_each_changed_setting():
    old = {'integration': {'record_samples': False, 'oom_recovery': 'auto'},
           'batch_growth': {'interval': 2, 'maximum': 4}, 'training_log': {'every': 1}}
    new = {'integration': {'record_samples': True, 'oom_recovery': 'auto'},
           'batch_growth': {'interval': 3, 'maximum': 4}, 'training_log': {'every': 5}, 'lr_schedule': {'warmup': 2}}
    assert settings_changes(old, new, ignore=('integration.record_samples', 'training_log')) == {
        'batch_growth.interval': [2, 3], 'lr_schedule': [None, {'warmup': 2}]}
    assert settings_changes(old, old) == {}


class Strict:
    state_key = 'integration.data'

    def load_state_dict(self, state):
        self.position = int(state['position'])
        self.ratio = 1 / int(state['epoch_size'])


@pytest.mark.parametrize('state,found', [({}, "missing field 'position'"), ({'position': 'x'}, 'ValueError'),
                                         ({'position': 1, 'epoch_size': 0}, 'ZeroDivisionError'),
                                         ([1, 2], 'expected a mapping')])
def test_a_wrong_value_in_the_state_names_the_file_and_the_component(state, found):
    with pytest.raises(StateError) as e:
        restore_components([Strict()], {'components': {'integration.data': state}}, source='ckpt/state.json')
    assert str(e.value).startswith('ckpt/state.json: integration.data: ') and found in str(e.value)
    assert 'a corrupt or edited state file' in str(e.value)


def test_a_state_the_pack_wrote_that_does_not_load_is_called_the_packs_defect_not_a_corrupt_file():
    """An intact file (its digest matched the checkpoint's binding) that does not load is the pack's own defect: the
    message says so and does not call the checkpoint corrupt."""
    with pytest.raises(StateError) as e:
        restore_components([Strict()], {'components': {'integration.data': {}}}, source='ckpt/state.json',
                           intact=True)
    assert 'is intact' in str(e.value) and 'defect of the pack' in str(e.value)
    assert 'corrupt' not in str(e.value)


# ---- real runs -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def saved_run(tmp_path_factory, tiny_llama, gsm8k_16):
    """8 steps of batch growth with checkpoints at 4 and 8."""
    import swift_dynamic_callbacks as sdc
    out = str(tmp_path_factory.mktemp('bound') / 'run')
    try:
        sdc.register(batch_growth=GROWTH, integration={'record_samples': True})
        run_sft(tiny_llama, 'llama', gsm8k_16, out, callbacks=['batch_growth'], **RUN)
    finally:
        plugin.unregister()
    return out


def _resume(tiny_llama, gsm8k_16, source: str, target: str, checkpoint: str, *, growth=None, integration=None,
            dataset=None, **flags):
    import swift_dynamic_callbacks as sdc
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    try:
        sdc.register(batch_growth=growth or GROWTH, integration={'record_samples': True, **(integration or {})})
        return run_sft(tiny_llama, 'llama', dataset or gsm8k_16, target, callbacks=['batch_growth'], fresh=False,
                       resume_from_checkpoint=os.path.join(target, checkpoint), **{**RUN, 'max_steps': 10, **flags})
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_intact_resume_continues_the_run(saved_run, tmp_path, tiny_llama, gsm8k_16):
    out = _resume(tiny_llama, gsm8k_16, saved_run, str(tmp_path / 'ok'), 'checkpoint-8')
    state = json.loads(open(os.path.join(out, 'checkpoint-10', STATE_FILE)).read())
    first = json.loads(open(os.path.join(saved_run, 'checkpoint-8', STATE_FILE)).read())
    assert state['binding']['run_id'] == first['binding']['run_id']  # the same run, resumed
    assert state['binding']['global_step'] == 10 and state['binding']['samples_seen'] > first['binding']['samples_seen']
    hf = json.loads(open(os.path.join(out, 'checkpoint-10', 'trainer_state.json')).read())
    assert hf['stateful_callbacks'][BINDING_KEY]['attributes']['state_sha256'] == file_digest(
        os.path.join(out, 'checkpoint-10', STATE_FILE))


@pytest.mark.e2e
def test_a_state_from_another_step_is_refused(saved_run, tmp_path, tiny_llama, gsm8k_16):
    target = str(tmp_path / 'copied')
    shutil.copytree(saved_run, target)
    shutil.copy(os.path.join(target, 'checkpoint-4', STATE_FILE), os.path.join(target, 'checkpoint-8', STATE_FILE))
    with pytest.raises(StateError, match='global_step: state file 4, checkpoint 8'):
        _resume(tiny_llama, gsm8k_16, target, str(tmp_path / 'resumed'), 'checkpoint-8')


@pytest.mark.e2e
def test_changed_settings_are_refused_unless_allowed_then_recorded(saved_run, tmp_path, tiny_llama, gsm8k_16):
    changed = {**GROWTH, 'interval': 3}
    with pytest.raises(StateError, match=r'batch_growth.interval: 2 -> 3.*allow_config_change: true'):
        _resume(tiny_llama, gsm8k_16, saved_run, str(tmp_path / 'refused'), 'checkpoint-4', growth=changed)
    out = _resume(tiny_llama, gsm8k_16, saved_run, str(tmp_path / 'allowed'), 'checkpoint-4', growth=changed,
                  integration={'allow_config_change': True})
    records = [d for d in decisions(out) if d['kind'] == 'config_change']
    assert [(d['values']['setting'], d['values']['old'], d['values']['new']) for d in records] == [
        ('batch_growth.interval', 2, 3)]
    # a logging setting may change freely
    _resume(tiny_llama, gsm8k_16, saved_run, str(tmp_path / 'logging'), 'checkpoint-4',
            integration={'record_samples': False})


@pytest.mark.e2e
def test_another_dataset_is_refused(saved_run, tmp_path, tiny_llama, gsm8k_16):
    rows = [json.loads(line) for line in open(gsm8k_16)]
    other = tmp_path / 'other.jsonl'
    other.write_text(''.join(json.dumps(r) + '\n' for r in rows[1:] + rows[:1]))  # same rows, another order
    with pytest.raises(StateError, match='another training dataset'):
        _resume(tiny_llama, gsm8k_16, saved_run, str(tmp_path / 'data'), 'checkpoint-8', dataset=str(other))


@pytest.mark.e2e
def test_ignore_data_skip_is_refused_with_the_packs_state(saved_run, tmp_path, tiny_llama, gsm8k_16):
    """HF's ``ignore_data_skip`` (start the epoch's data over) cannot hold with the pack's position: refused at
    start, never silently resumed at the next unseen sample."""
    with pytest.raises(ConfigError, match=r'ignore_data_skip: true cannot be honoured when resuming from .*-4'):
        _resume(tiny_llama, gsm8k_16, saved_run, str(tmp_path / 'skip'), 'checkpoint-4', ignore_data_skip=True)


def test_a_missing_state_file_is_refused_when_trainer_state_names_it(tmp_path):
    """A checkpoint whose trainer_state.json names the pack state but whose state file is gone is refused (naming the
    file and how to resume anyway); a checkpoint written without the pack still reads as ``None``."""
    (tmp_path / 'trainer_state.json').write_text(json.dumps(
        {'global_step': 4, 'stateful_callbacks': {BINDING_KEY: {'attributes': {'run_id': 'r'}}}}))
    with pytest.raises(StateError, match=rf'{STATE_FILE} is missing.*delete the {BINDING_KEY} entry'):
        read_state(tmp_path)
    (tmp_path / 'trainer_state.json').write_text(json.dumps({'global_step': 4, 'stateful_callbacks': {}}))
    assert read_state(tmp_path) is None


@pytest.mark.e2e
def test_a_checkpoint_without_its_state_file_is_refused(saved_run, tmp_path, tiny_llama, gsm8k_16):
    """Measured before: a pack checkpoint without dynamic_callbacks_state.json resumed by step arithmetic and trained
    samples twice. Now refused at start; with the entry removed from trainer_state.json it resumes on purpose."""
    target = str(tmp_path / 'missing')
    shutil.copytree(saved_run, target)
    os.remove(os.path.join(target, 'checkpoint-4', STATE_FILE))
    with pytest.raises(StateError, match=f'{STATE_FILE} is missing'):
        _resume(tiny_llama, gsm8k_16, target, str(tmp_path / 'resumed'), 'checkpoint-4')
    hf_file = os.path.join(target, 'checkpoint-4', 'trainer_state.json')
    hf = json.loads(open(hf_file).read())
    del hf['stateful_callbacks'][BINDING_KEY]
    open(hf_file, 'w').write(json.dumps(hf))
    out = _resume(tiny_llama, gsm8k_16, target, str(tmp_path / 'on_purpose'), 'checkpoint-4')
    assert [d['reason'] for d in decisions(out) if d['kind'] == 'resume'][-1] == 'no_pack_state'
