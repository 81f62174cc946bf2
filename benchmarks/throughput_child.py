"""The arms of ``bench_throughput.py``: ms-swift LoRA epochs measured the same way in every arm (a child process; run
by torchrun for several processes). Not a user entry point.

Usage: ``python benchmarks/throughput_child.py spec.json [spec.json ...]`` (or one spec under torchrun).
Several specs run one after another in this process (one process: the imports and the CUDA context are paid once);
after each, every rank writes ``<out>/throughput.rank<R>.json`` and rank 0 prints ``[arm-done] <out>``, so the parent
reports an arm as soon as it ends. A record holds, per micro-batch as it ran (step, rows, each row's real tokens, padded
tokens, real tokens, the work ``a x L + L^2``), per step the wall time at its end, the train time, peak RSS (and peak
GPU memory), steps and train loss; a profiled spec adds ``profile.json`` (see :class:`ProfileWindow`).

What runs (``spec['arm']``):

- ``random``: plain ms-swift (its sampler, fixed per-device batch), the pack not installed;
- ``group_by_length``: plain ms-swift with ``group_by_length: true``;
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` as the training loader's batch sampler (ms-swift 4.6
  builds its own sampler and never reads ``train_sampling_strategy``, so this child hands the trainer a loader over
  that sampler, with ms-swift's collator; ``drop_last`` false, as every other arm);
- ``pack_*``: the pack with ``spec['pack']`` (``length_batching`` settings);
- ``bare_loop``: the physical reference, no ms-swift and no Trainer: the same model folder through transformers +
  PEFT (the LoRA settings ms-swift uses: rank 8, alpha 32, every linear layer), the rows' lengths of an earlier arm of
  this process (random token ids), a seeded random order, micro-batches of the per-device batch, AdamW every
  ``ga`` micro-batches.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time
import traceback
import warnings
from typing import Any

LENGTHS: list[int] = []  # the rows' real lengths as an ms-swift arm of this process encoded them (for bare_loop)


def main(paths: list[str]) -> None:
    chains_done: set[str] = set()  # "the largest that fits": the first spec of a chain that runs, the rest skipped
    for path in paths:
        with open(path, encoding='utf-8') as f:
            spec = json.load(f)
        label = spec.get('label', spec['arm'])
        if spec.get('chain') in chains_done:
            continue
        if spec.get('deadline') is not None and time.time() > spec['deadline']:
            print(f'[arm-skipped] {label}: past --deadline', flush=True)
            continue
        started = time.monotonic()
        try:
            with memory_fraction(spec), dynamo_counts() as compiled:
                record = bare_loop(spec) if spec['arm'] == 'bare_loop' else swift_arm(spec)
        except BaseException as error:  # noqa: BLE001 - one failed arm must not lose the arms after it
            if int(os.environ.get('WORLD_SIZE', '1')) > 1 or isinstance(error, KeyboardInterrupt):
                raise  # several processes: the parent reports the child's exit and its log
            traceback.print_exc()
            cause = f'{type(error).__name__}: {" ".join(str(error).split())[:400]}'
            print(f'[arm-skipped] {label}: failed after {time.monotonic() - started:.0f} s: {cause}', flush=True)
            release_memory()
            continue
        if spec.get('warmup'):
            print(f'[arm-warmup] {label}: {time.monotonic() - started:.0f} s (not measured)', flush=True)
            continue
        record['dynamo'] = compiled
        record['pack'] = pack_decisions(spec['out'])
        write_record(spec, record)
        if spec.get('chain'):
            chains_done.add(spec['chain'])
        if int(os.environ.get('RANK', '0')) == 0:
            print(f'[arm-done] {spec["out"]}', flush=True)


class memory_fraction:  # noqa: N801 - a context manager used like a function
    """``spec['memory_fraction']`` of the GPU for this arm (``torch.cuda.set_per_process_memory_fraction``): a
    smaller card, or a memory end below the arm's pass budget; back to all of it afterwards."""

    def __init__(self, spec: dict) -> None:
        self.fraction = spec.get('memory_fraction')

    def __enter__(self) -> None:
        if self.fraction:
            import torch
            torch.cuda.set_per_process_memory_fraction(float(self.fraction))

    def __exit__(self, *exc: Any) -> None:
        if self.fraction:
            import torch
            release_memory()
            torch.cuda.set_per_process_memory_fraction(1.0)


class dynamo_counts:  # noqa: N801 - a context manager used like a function
    """What torch's compiler did during an arm (flex_attention's kernels): the growth of dynamo's counters, each
    group summed (``stats.unique_graphs``: graphs compiled; ``recompiles``: recompilations, by reason)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def _snapshot(self) -> dict[str, int]:
        try:
            from torch._dynamo.utils import counters
        except ImportError:
            return {}
        out = {}
        for group, values in counters.items():
            for key, value in values.items():
                if isinstance(value, int):
                    out[f'{group}.{key}'] = value
        return out

    def __enter__(self) -> dict[str, int]:
        self.before = self._snapshot()
        return self.counts

    def __exit__(self, *exc: Any) -> None:
        after = self._snapshot()
        self.counts.update({k: v - self.before.get(k, 0) for k, v in after.items() if v != self.before.get(k, 0)})


def pack_decisions(out: str) -> dict[str, Any]:
    """What the pack decided in an arm, from ``<out>/dynamic_decisions.jsonl``: ``pass_tokens: auto``'s choice, the
    token budget after OOMs (every change, the last one), the OOMs, the packed attention and a fallback from it."""
    path = os.path.join(out, 'dynamic_decisions.jsonl')
    if not os.path.exists(path):
        return {}
    with open(path, encoding='utf-8') as f:
        records = [json.loads(line) for line in f if line.strip()]
    budgets = [r['values']['new'] for r in records if r['kind'] == 'pass_budget']
    auto = [r['values'] for r in records if r['kind'] == 'pass_tokens']
    attention = [r for r in records if r['kind'] == 'packed_attention']
    return {'auto_pass_tokens': auto[0]['pass_tokens'] if auto else None,
            'auto_figures': auto[0] if auto else None,
            'pass_budgets': budgets, 'final_pass_budget': budgets[-1] if budgets else None,
            'ooms': sum(1 for r in records if r['kind'] == 'oom'),
            'attention': [(r['reason'], r['values'].get('why') or r['values'].get('error')) for r in attention]}


def write_record(spec: dict, record: dict) -> None:
    import torch
    rank = int(os.environ.get('RANK', '0'))
    record['peak_rss_gib'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if torch.cuda.is_available() and spec.get('device') == 'cuda':
        record['peak_cuda_gib'] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    record['rank'] = rank
    with open(os.path.join(spec['out'], f'throughput.rank{rank}.json'), 'w', encoding='utf-8') as f:
        json.dump(record, f)


#: the allocator counters recorded at every step's end on CUDA: retries (a cudaMalloc that failed, the cache freed,
#: tried again), OOMs, and reserved, active and inactive-split bytes (fragmentation near the limit)
ALLOC_KEYS = ('num_alloc_retries', 'num_ooms', 'reserved_bytes.all.current', 'active_bytes.all.current',
              'inactive_split_bytes.all.current')


def swift_arm(spec: dict) -> dict:
    import torch
    from swift import SftArguments, sft_main
    from swift.callbacks import callbacks_map
    from transformers import TrainerCallback

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.policies.balance import work_coefficient
    from swift_dynamic_callbacks.integrations.padding_free import PackedBatch
    from swift_dynamic_callbacks.data.slots import slot_batches
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs

    record: dict[str, Any] = {'micro': [], 'step_end': [], 'train_s': None, 'steps': None, 'train_loss': None}
    coef = {'a': None}

    def note(batch: Any, packed: bool) -> None:
        """One pass as HF receives it, read without synchronising: its shape now, its rows' lengths and whether it
        has labels kept as tensors (on the device, for a batch already there) and read after the run
        (:func:`resolve`); ``packed``: it runs as one packed row."""
        ids, mask, labels = batch['input_ids'], batch.get('attention_mask'), batch.get('labels')
        rows, width = int(ids.shape[0]), int(ids.shape[-1])
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            lengths: Any = mask.detach().sum(dim=1)
        elif isinstance(batch, PackedBatch):
            lengths = list(batch.row_lengths)
        elif rows == 1 and isinstance(batch.get('position_ids'), torch.Tensor):  # ms-swift's packed row
            lengths = batch['position_ids'][0].detach().clone()  # the rows restart at position 0
        else:
            lengths = [width] * rows
        labelled = (labels.detach() != -100).any() if isinstance(labels, torch.Tensor) else True
        record['micro'].append({'step': trainer_state['step'](), 'rows': rows, 'width': width, 'packed': packed,
                                'lengths': lengths, 'labelled': labelled})

    def resolve() -> None:
        """After the run: the passes' lengths and figures (the reads :func:`note` left for now)."""
        for m in record['micro']:
            lengths, width, rows = m['lengths'], m.pop('width'), m['rows']
            if isinstance(lengths, torch.Tensor) and lengths.dim() == 1 and m['rows'] == 1 and lengths.numel() > 1:
                starts = (lengths == 0).nonzero().flatten().tolist() + [width]  # packed row: position ids
                lengths = [b - a for a, b in zip(starts, starts[1:])]
            elif isinstance(lengths, torch.Tensor):
                lengths = lengths.tolist()
            if not bool(m.pop('labelled')):
                lengths = []  # a placeholder pass: work, no tokens
            total = sum(lengths)
            packed = m.pop('packed')
            m['lengths'] = lengths
            m['real'] = total
            m['padded'] = (width if packed else rows * width) if lengths else 0  # packed: with flex's filler
            m['work'] = (coef['a'] * total + total * total if packed else
                         rows * (coef['a'] * width + width * width)) if lengths else 0.0

    cuda = spec.get('device') == 'cuda' and torch.cuda.is_available()
    trainer_state = {'step': lambda: 0}

    class Meter(TrainerCallback):
        """Times the run and each step; wraps the trainer's ``training_step`` to see every pass of a step."""

        def __init__(self, trainer):
            self.trainer = trainer
            self.window = None
            packed = bool((spec['pack'].get('length_batching') or {}).get('padding_free'))

            def training_step(model, inputs, *args, **kwargs):
                # HF's call with a micro-batch slot (the pack's may be empty or hold several passes); nothing read
                # from the device here, the figures are read after the run
                for batch in slot_batches(inputs):
                    note(batch, packed)
                return type(trainer).training_step(trainer, model, inputs, *args, **kwargs)

            trainer.training_step = training_step
            if spec['arm'] == 'batch_rebalance':
                trainer.get_train_dataloader = lambda: rebalanced_loader(trainer)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            trainer_state['step'] = lambda: self.trainer.state.global_step
            record['engine_ran'] = engine_ran(self.trainer)
            config = getattr(model, 'config', None) or self.trainer.model.config
            coef['a'] = work_coefficient(getattr(config, 'hidden_size', None),
                                         getattr(config, 'intermediate_size', None))
            if cuda:
                torch.cuda.synchronize()
            record['start'] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            first, last = spec.get('profile_steps') or (None, None)
            if first is not None and state.global_step == first:
                self.window = ProfileWindow(spec, cuda)
                self.window.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            record['step_end'].append(time.perf_counter())
            if cuda:  # the caching allocator's counters (host-side: no synchronisation)
                stats = torch.cuda.memory_stats()
                record.setdefault('alloc', []).append({key: stats.get(key, 0) for key in ALLOC_KEYS})
            first, last = spec.get('profile_steps') or (None, None)
            if self.window is not None and state.global_step >= last:
                self.window.__exit__(None, None, None)
                self.window = None

        def on_train_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            record['train_s'] = time.perf_counter() - record['start']
            record['attention'] = getattr(self.trainer.model.config, '_attn_implementation', None)
            resolve()
            record['steps'] = state.global_step
            losses = [row['train_loss'] for row in state.log_history if 'train_loss' in row]
            record['train_loss'] = losses[-1] if losses else None

    callbacks_map['bench_meter'] = lambda args, trainer: Meter(trainer)
    callbacks = ['bench_meter']
    plugin.unregister()
    if spec['pack']:
        sdc.register(**spec['pack'])
        callbacks += [name for name in spec['pack'] if name != 'integration']
    settings = dict(
        callbacks=callbacks, max_steps=-1, num_train_epochs=1, per_device_train_batch_size=spec['batch'],
        gradient_accumulation_steps=spec['ga'], learning_rate=1e-4, lr_scheduler_type='constant', seed=spec['seed'],
        data_seed=spec['seed'], max_length=spec['max_length'], truncation_strategy='right',
        gradient_checkpointing=False, save_strategy='no', logging_steps=1000, lora_dropout=0.0, attn_impl='sdpa',
        group_by_length=spec['arm'] == 'group_by_length',
        use_cpu=(spec['procs'] > 1 or bool(spec.get('engine'))) and spec.get('device', 'cpu') == 'cpu')
    if spec.get('engine') and spec.get('device', 'cpu') == 'cpu':
        settings['ddp_backend'] = 'gloo'
        if spec['engine'].startswith('zero'):  # fp32 on CPU: the presets' "auto" precision would ask for fp16
            settings.update(fp16=False, bf16=False)
        if spec['engine'] == 'fsdp2':
            lift_cpu_to_fsdp()
    settings.update(spec['flags'])
    settings.update(spec.get('swift') or {})  # the benchmark's --swift settings win
    kwargs = offline_sft_kwargs(spec['model'], spec['data'], spec['out'], **settings)
    try:
        sft_main(SftArguments(**kwargs))
    finally:
        plugin.unregister()
    if not LENGTHS:
        LENGTHS.extend(n for m in record['micro'] for n in m['lengths'])
    release_memory()
    return record


def engine_ran(trainer: Any) -> dict[str, Any]:
    """The engine the trainer's accelerator runs, as the arm syntax names it (``single``, ``ddp``, ``zero2``,
    ``zero3``, ``fsdp2``, ``fsdp1``), with accelerate's distributed type and the wrapped model's class: an arm that
    asked for an engine and ran another is reported, never measured as if it had."""
    state = trainer.accelerator.state
    kind = str(getattr(state.distributed_type, 'name', state.distributed_type))
    name = 'single' if kind == 'NO' else 'ddp'
    if kind == 'DEEPSPEED':
        name = f'zero{state.deepspeed_plugin.zero_stage}'
    elif kind == 'FSDP':
        name = f'fsdp{getattr(state.fsdp_plugin, "fsdp_version", 1)}'
    wrapped = getattr(trainer, 'model_wrapped', None) or trainer.model
    return {'name': name, 'distributed_type': kind, 'wrapper': type(wrapped).__name__}


def lift_cpu_to_fsdp() -> None:
    """A CPU check of the ``+fsdp2`` arms: accelerate keeps ``MULTI_CPU`` (``NO`` with one process) when no
    accelerator exists and never starts FSDP there; lift that state to ``FSDP`` when an FSDP plugin is given (as
    the engine tests' driver does). Not used on CUDA, where accelerate starts FSDP itself."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    if getattr(AcceleratorState.__init__, 'lifted', False):
        return
    init = AcceleratorState.__init__

    def lifted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get('fsdp_plugin')
        if plugin is not None and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.NO):
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            PartialState._shared_state['distributed_type'] = self.distributed_type

    lifted.lifted = True
    AcceleratorState.__init__ = lifted


def bare_loop(spec: dict) -> dict:
    """The physical reference (module docstring): the same rows' lengths, no Trainer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from swift_dynamic_callbacks.policies.balance import work_coefficient
    if not LENGTHS:
        raise SystemExit('bare_loop needs the rows\' lengths of an ms-swift arm run before it in the same process')
    cuda = spec.get('device') == 'cuda' and torch.cuda.is_available()
    device = torch.device('cuda' if cuda else 'cpu')
    dtype = torch.bfloat16 if spec['flags'].get('torch_dtype') == 'bfloat16' else torch.float32
    torch.manual_seed(spec['seed'])
    model = AutoModelForCausalLM.from_pretrained(spec['model'], dtype=dtype, attn_implementation='sdpa').to(device)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules='all-linear'))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    coef = work_coefficient(model.config.hidden_size, model.config.intermediate_size)
    vocab = int(model.config.vocab_size)
    order = list(range(len(LENGTHS)))
    random.Random(spec['seed']).shuffle(order)
    batch, ga = spec['batch'], spec['ga']
    micro = [order[k:k + batch] for k in range(0, len(order), batch)]
    record: dict[str, Any] = {'micro': [], 'step_end': [], 'train_loss': None}
    generator = torch.Generator().manual_seed(spec['seed'])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses = []
    for k, rows in enumerate(micro):
        lengths = [LENGTHS[i] for i in rows]
        width = max(lengths)
        ids = torch.randint(0, vocab, (len(rows), width), generator=generator)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, n in enumerate(lengths):
            mask[r, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device),
                    use_cache=False)
        (out.loss / ga).backward()
        losses.append(out.loss.detach())
        record['micro'].append({'step': k // ga, 'rows': len(rows), 'lengths': lengths, 'padded': len(rows) * width,
                                'real': sum(lengths), 'work': len(rows) * (coef * width + width * width)})
        if k % ga == ga - 1 or k == len(micro) - 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record['step_end'].append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
    record['train_s'] = time.perf_counter() - start
    record['steps'] = len(record['step_end'])
    record['train_loss'] = float(torch.stack(losses).mean()) if losses else None
    del model, optimizer
    release_memory()
    return record


def release_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ProfileWindow:
    """Steps ``spec['profile_steps']`` of an arm under ``torch.profiler`` and, on CUDA, the synchronisation debug mode:
    writes ``<out>/profile.json`` with the window's wall time, the GPU's busy time (the sum of its kernels' time),
    the operators that took most host time, and every host-device synchronisation with the first frame outside torch
    that caused it (file:line, counted)."""

    def __init__(self, spec: dict, cuda: bool) -> None:
        self.spec, self.cuda = spec, cuda
        self.syncs: dict[str, int] = {}

    def __enter__(self) -> 'ProfileWindow':
        import torch
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        if self.cuda:
            self._show, warnings.showwarning = warnings.showwarning, self._note
            self._filters = warnings.filters[:]
            warnings.simplefilter('always')
            torch.cuda.set_sync_debug_mode('warn')
        self.start = time.perf_counter()
        return self

    def _note(self, message, category, filename, lineno, file=None, line=None) -> None:
        if 'synchroniz' not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if '/torch/' not in f.filename
                  and 'throughput_child' not in f.filename and 'warnings' not in f.filename]
        site = ' <- '.join(f'{shorten(f.filename)}:{f.lineno} {f.name}' for f in frames[-2:][::-1])
        self.syncs[site] = self.syncs.get(site, 0) + 1

    def __exit__(self, *exc: Any) -> None:
        import torch
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = self._show
            warnings.filters[:] = self._filters
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        self.profiler.__exit__(None, None, None)
        events = self.profiler.key_averages()
        device_us = sum(getattr(e, 'self_device_time_total', 0) or 0 for e in events)
        top = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:25]
        sync_calls = {e.key: e.count for e in events if 'ynchronize' in e.key or e.key in ('cudaMemcpyAsync',
                                                                                            'aten::item',
                                                                                            'aten::_local_scalar_dense')}
        first, last = self.spec['profile_steps']
        out = {'arm': self.spec['arm'], 'steps': last - first + 1, 'wall_s': wall,
               'gpu_busy_s': device_us / 1e6, 'sync_sites': dict(sorted(self.syncs.items(), key=lambda kv: -kv[1])),
               'sync_calls': sync_calls,
               'top_cpu': [{'op': e.key, 'count': e.count, 'cpu_total_ms': e.cpu_time_total / 1e3,
                            'device_ms': (getattr(e, 'device_time_total', 0) or 0) / 1e3} for e in top]}
        with open(os.path.join(self.spec['out'], 'profile.json'), 'w', encoding='utf-8') as f:
            json.dump(out, f, indent=1)


def shorten(path: str) -> str:
    for marker in ('site-packages/', 'swift_dynamic_callbacks/', 'scripts/'):
        if marker in path:
            return path.split(marker, 1)[1] if marker == 'site-packages/' else marker + path.split(marker, 1)[1]
    return os.path.basename(path)


def rebalanced_loader(trainer):
    """The training loader of the ``batch_rebalance`` arm: ``BatchRebalanceSampler`` over the encoded rows' lengths,
    ms-swift's collator; each rank gets its own micro-batches (the sampler deals them), so it is not sharded again."""
    import torch
    from transformers.trainer_pt_utils import BatchRebalanceSampler
    args, dataset = trainer.args, trainer.train_dataset
    lengths = [int(x) if not isinstance(x, list) else int(max(x)) for x in dataset['lengths']]
    world = max(1, args.world_size)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    sampler = BatchRebalanceSampler(
        lengths=lengths, effective_batch_size=global_batch,
        dp_size=world, grad_accum=args.gradient_accumulation_steps, seed=args.data_seed,
        rank=args.process_index if world > 1 else 0, drop_last=False)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=trainer.data_collator,
                                       num_workers=0)


if __name__ == '__main__':
    main(sys.argv[1:])
