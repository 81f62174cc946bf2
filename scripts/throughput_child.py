"""One arm of ``bench_throughput.py``: one ms-swift LoRA epoch, measured the same way in every arm (a child process;
run by torchrun for several processes). Not a user entry point.

Usage: ``python scripts/throughput_child.py spec.json`` (or under ``torch.distributed.run``). Every rank writes
``<out>/throughput.rank<R>.json``: per micro-batch (step, rows, padded tokens, real tokens, the work ``a x L + L^2``
of what ran), per step the wall time at its end, the train time, peak RSS, steps and train loss.

What runs (``spec['arm']``):

- ``random``: plain ms-swift (its sampler, fixed per-device batch), the pack not installed;
- ``group_by_length``: plain ms-swift with ``group_by_length: true``;
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` as the training loader's batch sampler (ms-swift 4.6
  builds its own sampler and never reads ``train_sampling_strategy``, so this child hands the trainer a loader over
  that sampler, with ms-swift's collator; ``drop_last`` false, as every other arm);
- ``pack_*``: the pack with ``spec['pack']`` (``length_batching`` settings).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path, encoding='utf-8') as f:
        spec = json.load(f)
    import torch
    from swift import SftArguments, sft_main
    from swift.callbacks import callbacks_map
    from transformers import TrainerCallback

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.policies.balance import work_coefficient
    from swift_dynamic_callbacks.tiny import offline_sft_kwargs

    rank = int(os.environ.get('RANK', '0'))
    record = {'micro': [], 'step_end': [], 'train_s': None, 'steps': None, 'train_loss': None}
    coef = {'a': None}

    class Meter(TrainerCallback):
        """Times the run and each step; wraps ``compute_loss`` to see every micro-batch as it runs."""

        def __init__(self, trainer):
            self.trainer = trainer
            original = trainer.compute_loss

            def compute_loss(model, inputs, *args, **kwargs):
                ids = inputs['input_ids']
                mask = inputs.get('attention_mask')
                rows, width = int(ids.shape[0]), int(ids.shape[-1])
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    lengths = [int(x) for x in mask.sum(dim=1)]
                    work = rows * (coef['a'] * width + width * width)
                else:  # one packed row (padding-free): sdpa / eager attend over the whole row under a mask
                    lengths = [width]
                    work = coef['a'] * width + width * width
                labels = inputs.get('labels')
                placeholder = isinstance(labels, torch.Tensor) and not bool((labels != -100).any())
                record['micro'].append({'step': self.trainer.state.global_step, 'rows': rows,
                                        'padded': 0 if placeholder else rows * width,
                                        'real': 0 if placeholder else sum(lengths), 'work': work})
                return original(model, inputs, *args, **kwargs)

            trainer.compute_loss = compute_loss
            if spec['arm'] == 'batch_rebalance':
                trainer.get_train_dataloader = lambda: rebalanced_loader(trainer)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            config = getattr(model, 'config', None) or self.trainer.model.config
            coef['a'] = work_coefficient(getattr(config, 'hidden_size', None),
                                         getattr(config, 'intermediate_size', None))
            record['start'] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            record['step_end'].append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            record['train_s'] = time.perf_counter() - record['start']
            record['steps'] = state.global_step
            losses = [row['train_loss'] for row in state.log_history if 'train_loss' in row]
            record['train_loss'] = losses[-1] if losses else None

    callbacks_map['bench_meter'] = lambda args, trainer: Meter(trainer)
    callbacks = ['bench_meter']
    if spec['pack']:
        sdc.register(**spec['pack'])
        callbacks += [name for name in spec['pack'] if name != 'integration']
    kwargs = offline_sft_kwargs(
        spec['model'], spec['data'], spec['out'], callbacks=callbacks, max_steps=-1, num_train_epochs=1,
        per_device_train_batch_size=spec['batch'], gradient_accumulation_steps=spec['ga'], learning_rate=1e-4,
        lr_scheduler_type='constant', seed=spec['seed'], data_seed=spec['seed'], max_length=spec['max_length'],
        truncation_strategy='right', gradient_checkpointing=False, save_strategy='no', logging_steps=1000,
        lora_dropout=0.0, attn_impl='sdpa', group_by_length=spec['arm'] == 'group_by_length',
        use_cpu=spec['procs'] > 1 and spec.get('device', 'cpu') == 'cpu', **spec['flags'])
    sft_main(SftArguments(**kwargs))
    record['peak_rss_gib'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if torch.cuda.is_available() and spec.get('device') == 'cuda':
        record['peak_cuda_gib'] = torch.cuda.max_memory_allocated() / 2**30
    record['rank'] = rank
    with open(os.path.join(spec['out'], f'throughput.rank{rank}.json'), 'w', encoding='utf-8') as f:
        json.dump(record, f)


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
    main(sys.argv[1])
