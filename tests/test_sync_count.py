"""The pack adds no host-device synchronisation per micro-batch: every call that would wait for a GPU (``.item()``,
``.tolist()``, ``bool()`` / ``if tensor``, ``.cpu()``, ``.numpy()``, ``int()`` / ``float()`` of a tensor, ``nonzero``,
a boolean-mask index, ``torch.cuda.synchronize``) that the pack's own code makes on the step path of a real swift sft
run is counted, by phase and call site.

- Per micro-batch (HF's ``training_step`` -> the step runner): none at all.
- Per step (the step boundary, ``get_batch_samples``): only the documented host-side reads of the collated batch
  (tokens counted from the host's attention mask, the all-ones mask check, padding-free packing), which run before
  the batch is copied to the device (``integrations/inputs.py``), and the loader's one seed draw per epoch.
- Per log line: the non-finite loss flags (one read per logged step), then HF's own logging.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

import swift_dynamic_callbacks

PACKAGE = os.path.dirname(swift_dynamic_callbacks.__file__)
METHODS = ('item', 'tolist', '__bool__', 'cpu', 'numpy', '__int__', '__float__', '__index__', 'nonzero')
#: the host-side reads the step boundary may make (module docstring), by function name
HOST_READS = {'count_tokens', 'same_length_rows', 'flatten_rows', 'start'}


class SyncCounter:
    """Counts synchronising tensor calls whose caller is the pack's code, with the phase the integration is in."""

    def __init__(self) -> None:
        self.phase = 'other'
        self.calls: Counter = Counter()
        self.micro_batches = self.steps = self.logs = 0

    def note(self, what: str) -> None:
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(PACKAGE):
            site = (f'{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:{frame.f_lineno} '
                    f'{frame.f_code.co_name}')
            self.calls[(self.phase, frame.f_code.co_name, site, what)] += 1

    def by_phase(self, phase: str) -> Counter:
        return Counter({k: v for k, v in self.calls.items() if k[0] == phase})


@contextmanager
def counting(monkeypatch):
    from swift_dynamic_callbacks.integrations.trainer import Integration
    counter = SyncCounter()
    for name in METHODS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            counter.note(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    original_getitem = torch.Tensor.__getitem__

    def getitem(self, index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            counter.note('bool-mask index')
        return original_getitem(self, index)

    monkeypatch.setattr(torch.Tensor, '__getitem__', getitem)
    original_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a, **k: (counter.note('cuda.synchronize'),
                                                                      original_sync(*a, **k))[1])

    def phased(name: str, phase: str, count: str):
        original = getattr(Integration, name)

        def method(self, *args, **kwargs):
            setattr(counter, count, getattr(counter, count) + 1)
            before, counter.phase = counter.phase, phase
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.phase = before

        monkeypatch.setattr(Integration, name, method)

    phased('next_step', 'step', 'steps')
    phased('run_micro_batch', 'micro', 'micro_batches')
    phased('update_logs', 'log', 'logs')
    yield counter


@pytest.mark.e2e
@pytest.mark.parametrize('settings,ga', [
    ({'length_batching': {'mode': 'balanced', 'pass_tokens': 1500, 'padding_free': True},
      'batch_growth': {'initial': 2, 'factor': 2, 'interval': 2, 'maximum': 4}}, 4),
    ({'batch_schedule': {'schedule': {0: 2}}, 'lr_schedule': {'warmup': 1}}, 2),
], ids=['passes-padding-free-growth', 'schedule-lr'])
def test_the_pack_makes_no_synchronising_call_per_micro_batch(tmp_path, tiny_qwen, settings, ga, monkeypatch):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import run_sft, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=12))
    try:
        sdc.register(**settings)
        with counting(monkeypatch) as counter:
            out = run_sft(tiny_qwen, 'qwen2', data, str(tmp_path / 'out'), callbacks=list(settings), max_steps=-1,
                          num_train_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=ga,
                          max_length=1024)
    finally:
        plugin.unregister()
    logs = train_logs(out)
    assert counter.steps == len(logs) and counter.micro_batches == ga * counter.steps  # HF's slots, all of them
    micro = counter.by_phase('micro')
    assert not micro, f'synchronising calls on the micro-batch path: {dict(micro)}'
    step = counter.by_phase('step')
    assert {function for _, function, _, _ in step} <= HOST_READS, dict(step)
    seeds = sum(n for (_, function, _, _), n in step.items() if function == 'start')
    assert seeds == 1  # the loader's seed draw, once in this one-epoch run
    log = counter.by_phase('log')
    assert sum(log.values()) <= 2 * len(logs), dict(log)  # the non-finite flags of the logged steps
    assert not counter.by_phase('other'), dict(counter.by_phase('other'))
    print(f'\nper step: {sum(step.values()) / counter.steps:.1f} host reads; per micro-batch: 0; per log line: '
          f'{sum(log.values()) / len(logs):.1f}; sites: {sorted({site for _, _, site, _ in step})}')
