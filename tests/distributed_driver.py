"""torchrun driver for the multi-process tests: one ms-swift LoRA run with the pack on every rank, under a named engine.

Usage: ``python -m torch.distributed.run --nproc_per_node 2 tests/distributed_driver.py spec.json`` (or plain
``python tests/distributed_driver.py spec.json`` for the one-process reference run).

``spec.json`` holds:

- ``sft``: ``SftArguments`` keyword arguments;
- ``engine``: ``single``, ``ddp``, ``fsdp2`` or ``deepspeed`` (the engine the run must train with: the trace records
  accelerate's distributed type and the wrapper class, and the tests assert them). ``fsdp2`` on CPU: accelerate 1.15
  starts FSDP only on accelerators, so this driver lifts accelerate's ``MULTI_CPU`` state to ``FSDP`` when an FSDP
  plugin is configured; ``fully_shard`` then runs over gloo. That is a test-only device, not a supported setup;
- ``pack``: the settings given to ``swift_dynamic_callbacks.register``;
- ``faults`` (per rank, keys ``"0"``/``"1"``): ``oom_token_budget`` (a pass of more padded tokens raises an OOM in
  forward), ``oom_forward_passes`` / ``oom_backward_passes`` (training passes, counted from 0 on this rank, that fail
  once in forward / mid-backward: :class:`~swift_dynamic_callbacks.testing.faults.OomInjector`), ``oom_eval_passes``
  (eval forwards, counted from 0 on this rank, that fail once), ``memory`` (``{step:
  fraction}`` read by a fake memory probe), ``monitor_value`` (``{step: value}`` fed to early stopping);
- ``replay_samples``: the ``dynamic_samples.rank<R>.jsonl`` files of a multi-process run: this (one-process) run
  trains, at every step, on the union of the micro-batches the ranks trained on in that step (the reference with
  the same global batch and the same samples per step; a step recorded with another number of micro-batches, as
  after a resume on another world size, is the same samples cut again into this run's);
- ``stop_at``: every rank stops (and saves) after this optimizer step, as a run killed right after a checkpoint;
- ``initial_weights``: a ``rank0.initial.pt`` of a multi-process run: this run's trainable parameters start from
  those values (the engines initialise LoRA under another random stream than one process does).

Every rank writes ``<output_dir>/rank<R>.initial.pt`` (the trainable parameters the engine starts the first step
with, gathered to full tensors),
``<output_dir>/rank<R>.trace.json`` (engine, distributed type, wrapper class, its decision records,
what the integration applied at every step boundary) and ``rank<R>.weights.pt`` (the trainable parameters after
training, gathered to full tensors).
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
        from swift_dynamic_callbacks.device_memory import MemorySample
        self.reads += 1
        value = int(self.fractions.get(self.reads, self.default) * 100)
        return MemorySample('fake', value, value, value, 100)


def _count_pack_collectives() -> dict[str, int]:
    """Count the collectives the pack itself calls (those made from ``swift_dynamic_callbacks/distributed.py``, the
    pack's only collective calls for decisions): ``passes`` while a step's passes run (``StepRunner.run_micro_batch``),
    ``boundary`` elsewhere. The engine's own collectives (FSDP2's gathers, DeepSpeed's reductions, the DDP adapter's
    all-reduce) are not counted."""
    import torch.distributed as dist

    from swift_dynamic_callbacks.integrations.steps import StepRunner
    calls = {'passes': 0, 'boundary': 0, 'in_passes': 0}
    for name in ('all_gather_object', 'all_reduce', 'broadcast_object_list', 'all_gather', 'broadcast'):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace(os.sep, '/')
            if caller.endswith('swift_dynamic_callbacks/distributed.py'):
                calls['passes' if calls['in_passes'] else 'boundary'] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    run_micro_batch = StepRunner.run_micro_batch

    def counted_micro_batch(self, *args, **kwargs):
        calls['in_passes'] += 1
        try:
            return run_micro_batch(self, *args, **kwargs)
        finally:
            calls['in_passes'] -= 1

    StepRunner.run_micro_batch = counted_micro_batch
    return calls


def _close_step(steps: list[dict], calls: dict[str, int]) -> None:
    """The pack's collectives during the last traced step's passes, into its trace line (once)."""
    if steps and 'passes_mark' in steps[-1]:
        steps[-1]['pack_collectives_in_passes'] = calls['passes'] - steps[-1].pop('passes_mark')


def _lift_cpu_to_fsdp() -> None:
    """Make accelerate run FSDP2 on CPU processes (test-only: it keeps ``MULTI_CPU`` when no accelerator exists)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType
    init = AcceleratorState.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get('fsdp_plugin')
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            from accelerate.state import PartialState
            PartialState._shared_state['distributed_type'] = self.distributed_type

    AcceleratorState.__init__ = patched


def _full_trainable(trainer) -> dict:
    """The trainable parameters as full tensors (collective under FSDP2 / ZeRO-3: every rank calls it)."""
    import torch
    model = trainer.model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = {}
    if any(hasattr(p, 'ds_id') for _, p in named):  # ZeRO-3 partitioned parameters
        import deepspeed
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            for n, p in named:
                out[n] = p.detach().clone().float()
        return out
    for n, p in named:
        value = p.full_tensor() if hasattr(p, 'full_tensor') else p
        out[n] = value.detach().clone().float()
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    return out


def _replay_patch(paths: list[str]) -> None:
    """One process trains on the union of the ranks' micro-batches of every step (see the module docstring)."""
    from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
    from swift_dynamic_callbacks.data.slots import EmptyMicroBatch
    rows = []
    for path in paths:
        with open(path, encoding='utf-8') as f:
            rows.append([json.loads(line) for line in f if line.strip()])
    by_step: dict[int, list[list[int]]] = {}
    for rank_rows in rows:
        for row in rank_rows:
            by_step.setdefault(int(row['step']), []).extend(row['batches'])
    state = {'step': 0}

    def next_step(self, entries):
        state['step'] += 1
        batches = by_step.get(state['step'])
        if batches is None:
            raise RuntimeError(f'replay: no recorded micro-batches for step {state["step"]}')
        if len(batches) != entries:  # another layout (a resume on another world size): the same samples, re-cut
            flat = [i for batch in batches for i in batch]
            base, extra = divmod(len(flat), entries)
            sizes = [base] * (entries - extra) + [base + 1] * extra
            batches = [flat[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(entries)]
        out = []
        for indices in batches:
            if not indices:
                out.append(([], EmptyMicroBatch()))
                continue
            out.append((list(indices), self.collate_fn([self.dataset[i] for i in indices])))
            self.shard.samples_seen += len(indices)
        return out

    ElasticDataLoader.next_step = next_step


def _skip_shm_comm_build() -> None:
    """On CPU, DeepSpeed's process group JIT-compiles its shared-memory all-reduce (``deepspeed_shm_comm``, with
    ninja, into one folder every environment shares) when it starts: about 45 s of both cores, again after every
    change of environment. The op serves ``inference_all_reduce`` only; training's collectives are torch.distributed's
    either way, so the test ranks mark it unavailable and DeepSpeed goes on without it (nothing a test checks changes).
    """
    import torch
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False


def main(spec_path: str) -> None:
    with open(spec_path, encoding='utf-8') as f:
        spec = json.load(f)
    rank = int(os.environ.get('RANK', '0'))
    faults = spec.get('faults', {}).get(str(rank), {})
    output_dir = spec['sft']['output_dir']
    engine = spec.get('engine', 'ddp')
    if engine == 'fsdp2':
        _lift_cpu_to_fsdp()
    if engine == 'deepspeed':
        _skip_shm_comm_build()

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.callbacks import early_stopping, memory_backoff
    from swift_dynamic_callbacks.integrations.trainer import Integration

    if spec.get('replay_samples'):
        _replay_patch(spec['replay_samples'])

    steps: list[dict] = []
    pack_calls = _count_pack_collectives()
    next_step = Integration.next_step
    # decided before training, the same on every rank (saving is collective); a resumed run keeps the first run's
    save_initial = not os.path.exists(os.path.join(output_dir, 'rank0.initial.pt'))

    def traced_next_step(self, num_batches, device, original):
        if not steps and save_initial:
            import torch  # the weights the engine starts from (after wrapping: FSDP2 shards each rank's own init)
            torch.save(_full_trainable(self.trainer), os.path.join(output_dir, f'rank{rank}.initial.pt'))
        noise = getattr(self.trainer.control, 'grad_noise_sample', None)
        if noise is not None and steps:  # the previous step's gradient-noise measurement (cleared by next_step)
            steps[-1]['noise'] = {'small_sqnorm': noise.small_sqnorm, 'big_sqnorm': noise.big_sqnorm}
        _close_step(steps, pack_calls)
        before = pack_calls['boundary'] + pack_calls['passes']
        result = next_step(self, num_batches, device, original)
        if self.runner.batches:  # a real step (not the no-op of a run that has already stopped)
            steps.append({
                'pack_collectives_boundary': pack_calls['boundary'] + pack_calls['passes'] - before,
                'passes_mark': pack_calls['passes'],
                'step': self.trainer.state.global_step + 1,
                'batch_size': self.loader.batch_size,
                'num_pieces': self.loader.num_pieces,
                'pass_limit': self.runner.effective_pass_limit(),  # the requested limit and the OOM budget
                'lr': self.step_lr,
                'epoch': self.loader.epoch,
                'samples': sum(len(i) for i in self.runner.indices),
            })
        return result

    end_train = Integration.end_train

    def traced_end_train(self):
        trainer = self.trainer
        if sys.exc_info()[0] is not None:  # training failed on this rank: gathering the weights would be a collective
            end_train(self)                # the other ranks never enter (they wait where they are, or have ended)
            return
        _close_step(steps, pack_calls)
        try:
            end_train(self)
        finally:
            import torch
            weights = _full_trainable(trainer)
            torch.save(weights, os.path.join(output_dir, f'rank{rank}.weights.pt'))
            engine_name = self.runner.engine.name
            trace = {
                'rank': rank,
                'world_size': distributed.world_size(),
                'distributed_type': str(trainer.accelerator.distributed_type).split('.')[-1],
                'wrapper': type(trainer.model_wrapped).__name__,
                'model_class': type(trainer.model).__name__,
                'engine': engine_name,
                'global_step': trainer.state.global_step,
                'decisions': [r.to_json() for r in self.decisions.records],
                'steps': steps,
            }
            with open(os.path.join(output_dir, f'rank{rank}.trace.json'), 'w', encoding='utf-8') as f:
                json.dump(trace, f, default=str)

    begin = Integration.begin_train

    def traced_begin_train(self, resume_from_checkpoint):
        import torch
        if spec.get('initial_weights'):
            start = torch.load(spec['initial_weights'])
            with torch.no_grad():
                for n, p in self.trainer.model.named_parameters():
                    if p.requires_grad:
                        p.copy_(start[n])
        return begin(self, resume_from_checkpoint)

    after_step = Integration.after_step

    def after_step_with_stop(self, state, control):
        after_step(self, state, control)
        if spec.get('stop_at') and state.global_step >= int(spec['stop_at']):
            control.should_training_stop = control.should_save = True

    Integration.after_step = after_step_with_stop
    Integration.next_step = traced_next_step
    Integration.end_train = traced_end_train
    Integration.begin_train = traced_begin_train

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
    if faults.get('oom_token_budget') or faults.get('oom_forward_passes') or faults.get('oom_backward_passes') \
            or faults.get('oom_eval_passes'):
        from swift_dynamic_callbacks.testing.faults import OomInjector
        injector = OomInjector(token_budget=int(faults.get('oom_token_budget') or 0) or None,
                               forward_passes=tuple(faults.get('oom_forward_passes', ())),
                               fail_passes=tuple(faults.get('oom_backward_passes', ())),
                               eval_passes=tuple(faults.get('oom_eval_passes', ())))
        begin_train = Integration.begin_train

        def begin_train_with_injector(self, resume_from_checkpoint):
            injector.install()  # after ms-swift loaded (and patched) the model: the injector wraps the final forward
            return begin_train(self, resume_from_checkpoint)

        Integration.begin_train = begin_train_with_injector

    timers = None
    if spec.get('step_times'):  # benchmark: wall time at every optimizer step's end (any engine, pack or not)
        from swift.callbacks import callbacks_map

        from swift_dynamic_callbacks.testing.timing import StepTimer
        callbacks_map['step_timer'] = timers = StepTimer.factory()
    if spec.get('pack') is not None:
        pack = spec['pack']
        backoff = pack.get('memory_backoff')
        if backoff is not None and spec['sft'].get('use_cpu') and 'cpu_budget_gib' not in backoff:
            # the probe is the fake above, whatever the budget; use_cpu: true without one is refused at launch
            pack = {**pack, 'memory_backoff': {**backoff, 'cpu_budget_gib': 100}}
        sdc.register(pack)
    from swift import SftArguments, sft_main
    if spec.get('profile') and rank == 0:
        import cProfile
        cProfile.runctx('sft_main(SftArguments(**spec["sft"]))', globals(), {**locals(), 'sft_main': sft_main,
                        'SftArguments': SftArguments, 'spec': spec}, os.path.join(output_dir, 'rank0.prof'))
    else:
        sft_main(SftArguments(**spec['sft']))
    if timers is not None:
        with open(os.path.join(output_dir, f'rank{rank}.times.json'), 'w', encoding='utf-8') as f:
            json.dump([wall for wall, _ in timers.last.step_ends], f)
    if injector is not None:
        with open(os.path.join(output_dir, f'rank{rank}.injected.json'), 'w', encoding='utf-8') as f:
            json.dump({**injector.counts, 'passes': injector.passes, 'eval_ooms': injector.eval_ooms}, f)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():  # a clean shutdown: gloo threads left running can abort exit
        dist.barrier()
        dist.destroy_process_group()


if __name__ == '__main__':
    main(sys.argv[1])
