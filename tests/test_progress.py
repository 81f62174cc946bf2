"""The progress bar (ms-swift's tqdm ``Train`` bar, HF's ``ProgressCallback``) follows every ``max_steps`` change the
pack makes, down (batch growth) and up (a smaller batch), and a run ends at N/N."""

from __future__ import annotations

import re

import pytest

from swift_runs import decisions, run_sft, train_logs

pytestmark = pytest.mark.e2e

_BAR = re.compile(r'Train:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[')


@pytest.mark.parametrize('schedule, steps', [({0: 1, 2: 4}, 6), ({0: 4, 2: 1}, 10)], ids=['shrinks', 'grows'])
def test_bar_total_follows_max_steps_and_ends_at_n_of_n(schedule, steps, tmp_path, tiny_llama, gsm8k_16, capfd):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_schedule={'schedule': schedule})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_schedule'],
                      max_steps=-1, num_train_epochs=1, per_device_train_batch_size=schedule[0])
    finally:
        plugin.unregister()
    err = capfd.readouterr().err
    bars = [(int(n), int(total)) for n, total in _BAR.findall(err)]
    logs = train_logs(out)
    assert len(logs) == steps
    changes = [d for d in decisions(out) if d['kind'] == 'max_steps' and d['reason'] == 'batch_size']
    assert changes and changes[-1]['values']['new'] == steps  # the pack changed max_steps ...
    assert bars[-1] == (steps, steps), bars[-3:]  # ... and the bar ends at N/N
    assert {total for n, total in bars if n >= 3} == {steps}  # the total followed the change as soon as it was made
    assert logs[-1]['global_step/max_steps'] == f'{steps}/{steps}'
