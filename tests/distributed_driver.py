"""torchrun driver for ``tests/test_distributed.py``: one ms-swift LoRA run with the pack on every rank.

Usage: ``python -m torch.distributed.run --nproc_per_node 2 tests/distributed_driver.py spec.json``.

``spec.json`` holds ``sft`` (``SftArguments`` keyword arguments, ``ddp_backend: gloo``), ``pack`` (the settings
given to ``swift_dynamic_callbacks.register``) and ``faults`` (per rank, keys ``"0"``/``"1"``):

- ``oom_token_budget``: an :class:`~swift_dynamic_callbacks.faults.OomInjector` on this rank only: a training
  pass of more padded tokens than this raises an out-of-memory error in forward;
- ``memory``: ``{step: fraction}`` read by a fake memory probe at the end of that step on this rank only (every other
  reading is 0.1);
- ``monitor_value``: ``{step: value}`` fed to early stopping as the monitored training value on this rank only.

Every rank writes ``<output_dir>/rank<R>.trace.json``: its decision records (the in-memory copy every rank keeps;
only rank 0 writes ``dynamic_decisions.jsonl``), what the integration applied at every step boundary (batch size,
pieces, pass limit, LR) and its optimizer step count.
"""

from __future__ import annotations

import json
import os
import sys


class FakeProbe:
    """A memory probe that reads ``fractions[step]`` at the end of step ``step`` (else ``default``)."""

    name = 'fake'
    budget = 100

    def __init__(self, fractions: dict[str, float], default: float = 0.1) -> None:
        self.fractions = {int(k): float(v) for k, v in fractions.items()}
        self.default = default
        self.reads = 0

    def reset_peak(self) -> None:
        pass

    def read(self):
        from swift_dynamic_callbacks.memory import MemorySample
        self.reads += 1
        value = int(self.fractions.get(self.reads, self.default) * 100)
        return MemorySample('fake', value, value, value, 100)


def main(spec_path: str) -> None:
    with open(spec_path, encoding='utf-8') as f:
        spec = json.load(f)
    rank = int(os.environ.get('RANK', '0'))
    faults = spec.get('faults', {}).get(str(rank), {})
    output_dir = spec['sft']['output_dir']

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.callbacks import early_stopping, memory_backoff
    from swift_dynamic_callbacks.integrations.trainer import Integration

    steps: list[dict] = []
    next_step = Integration.next_step

    def traced_next_step(self, num_batches, device, original):
        result = next_step(self, num_batches, device, original)
        if self._step_batches:  # a real step (not the no-op of a run that has already stopped)
            steps.append({
                'step': self.trainer.state.global_step + 1,
                'batch_size': self.loader.batch_size,
                'num_pieces': self.loader.num_pieces,
                'pass_limit': self.pass_limit,
                'lr': self.step_lr,
                'epoch': self.loader.epoch,
                'samples': sum(len(i) for i in self._step_indices),
            })
        return result

    end_train = Integration.end_train

    def traced_end_train(self):
        try:
            end_train(self)
        finally:
            trace = {
                'rank': rank,
                'world_size': distributed.world_size(),
                'global_step': self.trainer.state.global_step,
                'decisions': [r.to_json() for r in self.decisions.records],
                'steps': steps,
            }
            with open(os.path.join(output_dir, f'rank{rank}.trace.json'), 'w', encoding='utf-8') as f:
                json.dump(trace, f, default=str)

    Integration.next_step = traced_next_step
    Integration.end_train = traced_end_train

    memory = faults.get('memory', {})
    memory_backoff.auto_probe = lambda budget: FakeProbe(memory)

    values = {int(k): float(v) for k, v in faults.get('monitor_value', {}).items()}
    if values:
        on_log = early_stopping.EarlyStoppingCallback.on_log

        def fed_on_log(self, args, state, control, logs=None, **kwargs):
            if logs and state.global_step in values and self.config.monitor in logs:
                logs = {**logs, self.config.monitor: values[state.global_step]}
            return on_log(self, args, state, control, logs=logs, **kwargs)

        early_stopping.EarlyStoppingCallback.on_log = fed_on_log

    injector = None
    if faults.get('oom_token_budget'):
        from swift_dynamic_callbacks.faults import OomInjector
        injector = OomInjector(token_budget=int(faults['oom_token_budget']))
        begin_train = Integration.begin_train

        def begin_train_with_injector(self, resume_from_checkpoint):
            injector.install()  # after ms-swift loaded (and patched) the model, so the injector wraps the final forward
            return begin_train(self, resume_from_checkpoint)

        Integration.begin_train = begin_train_with_injector

    sdc.register(spec.get('pack', {}))
    from swift import SftArguments, sft_main
    sft_main(SftArguments(**spec['sft']))
    if injector is not None:
        with open(os.path.join(output_dir, f'rank{rank}.injected.json'), 'w', encoding='utf-8') as f:
            json.dump({**injector.counts, 'passes': injector.passes}, f)


if __name__ == '__main__':
    main(sys.argv[1])
