"""What a training pass holds a token under each engine: the check of ``pass_tokens: auto``'s engine factors.

``pass_tokens: auto`` sizes passes from the free device memory and the bytes a token's activations take, times the
engine adapter's ``activation_factor`` (1.5 under DeepSpeed ZeRO-3, from one H100 run where ZeRO-3 held 61.4 GiB at a
pass of 8,192 tokens against an estimate of 45.6; 1.0 elsewhere, FSDP2 unmeasured on a GPU). This measures the factor
itself: one forward and backward of a LoRA model (a Qwen2 shape with random weights, ``all-linear`` adapters with
dropout, as ms-swift's LoRA) at two pass lengths, without an engine, under FSDP2 (``fully_shard`` on every decoder layer
and the root) and under ZeRO-3 (the model built in ``deepspeed.zero.Init``, so DeepSpeed's own linear function runs, as
ms-swift builds it), each in its own process (one rank: gloo on CPU, nccl on CUDA). The bytes a token holds are slopes
between the two lengths, of what the forward leaves for the backward (the saved activations) and of the pass's peak; the
rest (gathered parameters an engine keeps) is the fixed part.

The peak is the largest sum of the storages the pass allocates and holds at once, counted by a
``TorchDispatchMode`` (every op's new storages, freed when Python drops them), so it runs on a CPU; on CUDA the
allocator's peak (``max_memory_allocated`` over what was allocated before the pass) is reported beside it, and that
one holds what the caching allocator does across streams (ZeRO-3 gathers on a stream of its own).

Usage (the ``deepspeed`` extra; about 3 minutes on one CPU core):
    python scripts/bench_activation_bytes.py                        # the 1.5B shape's layers, 2 of them, bf16
    python scripts/bench_activation_bytes.py --device cuda --layers 28 --vocab 151936 --tokens 2048 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import weakref
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ('none', 'zero3', 'fsdp2')  # ZeRO-3's factor first: a time limit loses FSDP2's


def peak_mode() -> Any:
    """A ``TorchDispatchMode`` that counts the bytes of the storages created while it is active (``keep``: storages
    alive before, never counted): ``cur`` and ``peak``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class PeakBytes(TorchDispatchMode):
        def __init__(self, keep: list) -> None:
            super().__init__()
            self.skip = {t.untyped_storage()._cdata for t in keep}
            self.live: dict[int, int] = {}
            self.cur = self.peak = 0

        def _free(self, key: int) -> None:
            self.cur -= self.live.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if type(t) not in (torch.Tensor, torch.nn.Parameter):
                    continue
                storage = t.untyped_storage()
                key, size = storage._cdata, storage.nbytes()
                if size == 0 or key in self.skip or key in self.live:
                    continue
                self.live[key] = size
                self.cur += size
                self.peak = max(self.peak, self.cur)
                weakref.finalize(storage, self._free, key)
            return out

    return PeakBytes


def measure(engine: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """One pass of ``tokens`` tokens under ``engine`` in this process (after one unmeasured pass): its peak bytes
    and the bytes still held after it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dtype = getattr(torch, args.dtype)
    cuda = args.device == 'cuda'
    # a world of one rank on its own port, whatever the environment says (a launcher's variables are not this one's)
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(args.port), RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')
    hidden, intermediate, heads, kv = args.shape
    config = Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=args.vocab,
                         tie_word_embeddings=True, attn_implementation='sdpa')
    torch.manual_seed(0)
    ds_config = {'train_micro_batch_size_per_gpu': 1, 'gradient_accumulation_steps': 1,
                 'zero_optimization': {'stage': 3, 'reduce_bucket_size': hidden * hidden,  # HF's "auto" values
                                       'stage3_prefetch_bucket_size': int(0.9 * hidden * hidden),
                                       'stage3_param_persistence_threshold': 10 * hidden},
                 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-4, 'torch_adam': True}},
                 **({'bf16': {'enabled': True}} if dtype == torch.bfloat16 else {})}
    if engine == 'zero3':
        import deepspeed
        deepspeed.init_distributed('nccl' if cuda else 'gloo')
        with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
            model = Qwen2ForCausalLM(config).to(dtype)
    else:
        model = Qwen2ForCausalLM(config).to(dtype)
        if cuda:
            model = model.cuda()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=args.lora_dropout,
                                             target_modules='all-linear'))
    model.train()
    run = model
    if engine == 'fsdp2':
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group('nccl' if cuda else 'gloo')
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif engine == 'zero3':
        import deepspeed
        run, *_ = deepspeed.initialize(model=model, config=ds_config,
                                       model_parameters=[p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, args.vocab, (1, tokens), device='cuda' if cuda else 'cpu')

    forward = []

    def one_pass() -> None:
        loss = run(input_ids=ids, labels=ids).loss
        forward.append(getattr(mode, 'cur', 0))  # what the forward left for the backward (the saved activations)
        if engine == 'zero3':
            run.backward(loss)
        else:
            loss.backward()
        for p in model.parameters():
            p.grad = None

    mode = None
    one_pass()  # lazy buffers and states: not a pass's
    import gc
    gc.collect()
    before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    mode = peak_mode()(keep=[*model.parameters(), *model.buffers()])
    with mode:
        one_pass()
    out = {'engine': engine, 'tokens': tokens, 'forward_mib': forward[-1] / 2**20, 'peak_mib': mode.peak / 2**20,
           'held_after_mib': mode.cur / 2**20}
    if cuda:
        torch.cuda.synchronize()
        out['cuda_peak_mib'] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--engines', nargs='+', choices=ENGINES, default=list(ENGINES))
    parser.add_argument('--tokens', type=int, nargs=2, default=[256, 512], metavar=('SHORT', 'LONG'))
    parser.add_argument('--shape', type=int, nargs=4, default=[1536, 8960, 12, 2],
                        metavar=('HIDDEN', 'INTERMEDIATE', 'HEADS', 'KV_HEADS'), help='default: Qwen2.5-1.5B')
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--vocab', type=int, default=2048, help="small by default: the layers' bytes, not the logits'")
    parser.add_argument('--dtype', choices=('bfloat16', 'float32'), default='bfloat16')
    parser.add_argument('--lora-dropout', type=float, default=0.05, help="ms-swift's default")
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu')
    parser.add_argument('--port', type=int, default=0, help='the rendezvous port (0: a free one for each process)')
    parser.add_argument('--child', nargs=2, metavar=('ENGINE', 'TOKENS'), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens[0] >= args.tokens[1]:
        parser.error(f'--tokens: SHORT below LONG, got {args.tokens[0]} and {args.tokens[1]}')
    if args.child:
        print('[activation-bytes] ' + json.dumps(measure(args.child[0], int(args.child[1]), args)), flush=True)
        return 0
    from benchmarks.common import free_port, machine_lines
    print('\n'.join(machine_lines(sys.argv, args.device)))
    print(f'\nShape: hidden {args.shape[0]}, intermediate {args.shape[1]}, {args.layers} layers, heads '
          f'{args.shape[2]} / {args.shape[3]}, vocab {args.vocab}, {args.dtype}, LoRA r 8 all-linear, dropout '
          f'{args.lora_dropout}; passes of {args.tokens[0]} and {args.tokens[1]} tokens; one process each\n')
    rows: dict[str, dict[int, dict]] = {}
    given = list(argv if argv is not None else sys.argv[1:])
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))}
    for engine in args.engines:
        for tokens in args.tokens:
            port = ['--port', str(args.port or free_port())]  # the last --port given wins
            command = [sys.executable, '-m', 'benchmarks.activation_bytes', *given, *port, '--child', engine,
                       str(tokens)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
            lines = [x for x in done.stdout.splitlines() if x.startswith('[activation-bytes] ')]
            if done.returncode or not lines:
                print(f'[arm-skipped] {engine} at {tokens} tokens: failed (rc {done.returncode}): '
                      f'{done.stderr.strip()[-1500:]}', flush=True)
                continue
            rows.setdefault(engine, {})[tokens] = json.loads(lines[-1].split(' ', 1)[1])
            print(lines[-1], flush=True)  # as it comes: a time limit loses no finished measurement
    print(table(rows, args.tokens))
    return 0


def table(rows: dict[str, dict[int, dict]], tokens: list[int]) -> str:
    """Per engine, each a slope between the two lengths (MiB a token) and its ratio to no engine's: what the forward
    leaves for the backward (the saved activations), the pass's peak, and the CUDA allocator's peak when there; the
    fixed part of the peak (the peak less the tokens' bytes) and what is held after the pass."""
    short, long = tokens
    keys = ('forward_mib', 'peak_mib', 'cuda_peak_mib')
    slopes = {engine: {k: (by[long][k] - by[short][k]) / (long - short) for k in keys if k in by[long]}
              for engine, by in rows.items() if short in by and long in by}
    base = slopes.get('none', {})
    out = ['| engine | forward: MiB a token | x no engine | peak: MiB a token | x no engine | CUDA peak: MiB a token | '
           'x no engine | fixed MiB | held after MiB |', '|---|' + '---:|' * 8]
    for engine, slope in slopes.items():
        cells = []
        for k in keys:
            if k not in slope:
                cells += ['–', '–']
                continue
            cells += [f'{slope[k]:.4f}', f'{slope[k] / base[k]:.2f}' if base.get(k) else '–']
        by = rows[engine][long]
        cells += [f'{by["peak_mib"] - slope["peak_mib"] * long:.1f}', f'{by["held_after_mib"]:.1f}']
        out.append(f'| {engine} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(out)


if __name__ == '__main__':
    sys.exit(main())
