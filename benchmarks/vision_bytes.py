"""What a vision-language pass holds: measured activation bytes against the pass cost model's prediction.

The pass cost model prices a pass in language-model tokens (:mod:`swift_dynamic_callbacks.policies.pass_cost`); a
Qwen-VL pass also runs its images' and videos' patches through the vision tower, ``merge^2`` patches an image token.
:func:`~swift_dynamic_callbacks.policies.pass_cost.vision_token_cost` turns that work into tokens: what the tower adds
to the pass's peak an image (video) token, over a language-model token's bytes. This measures it. One row of
``--tokens`` tokens a pass, the model's real layer widths with few layers (random weights, LoRA r 8 with dropout 0.05
as ms-swift's: on the language model only, the vision tower frozen, ``freeze_vit``'s default; or ``all-linear``, the
tower trained too), passes of text only, images only, a video only and images + a video, each holding the same number
of tokens. The bytes are :mod:`.activation_bytes`' storage counter (every storage an op allocates, while it lives; on a
CPU). The prediction of a pass is its cost in tokens (its tokens + its media tokens x the vision token cost) times the
bytes a token of the text-only pass of the same length (measured): so it checks the vision part of the cost model, on
the language model's own scale, which ``pass_tokens: auto`` sets from the device's memory.

Usage (transformers' model classes only: no processor, no torchvision; about 10 minutes on 2 CPU cores):
    python scripts/bench_vision_bytes.py                       # Qwen2.5-VL and Qwen3.5 shapes, frozen and trained
    python scripts/bench_vision_bytes.py --arch qwen3_5 --tower trained --depth 4
    python scripts/bench_vision_bytes.py --device cuda --dtype bfloat16 --layers 28 --depth 32 --vocab 151936 \
        --tokens 4096                                          # on a GPU: the towers' real depths, the allocator
    python scripts/bench_vision_bytes.py --reprice LOG --dtype bfloat16 --layers 28 --depth 32 --vocab 151936 \
        --tokens 4096                                          # a run's output priced by the cost model as it is now
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ('qwen2_5_vl', 'qwen3_5')
TOWERS = ('frozen', 'trained')
#: token ids of the benchmark's vocabulary (below ``--vocab``)
IMAGE, VIDEO, START, END = 2000, 2001, 2002, 2003
#: the passes: (images as (h, w) patch grids, videos as (t, h, w)); each filled with text up to --tokens
PASSES: dict[str, tuple[list[tuple[int, int]], list[tuple[int, int, int]]]] = {
    'text': ([], []),
    'images': ([(16, 32)] * 4, []),
    'video': ([], [(2, 16, 32)]),
    'mixed': ([(16, 32)], [(2, 16, 32)]),
}
#: language model: Qwen2.5-1.5B's layer widths (the shape :mod:`.activation_bytes` measures); vision towers: the
#: families' own (every size of a family shares its tower)
TEXT = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)
#: Qwen3.5's Gated DeltaNet widths (its linear-attention layers)
LINEAR = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)
VISION = {
    'qwen2_5_vl': dict(hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112),
    'qwen3_5': dict(hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
                    temporal_patch_size=2, num_position_embeddings=2304),
}


def layer_types(arch: str, layers: int) -> list[str]:
    """The decoder's layer types: Qwen3.5's every fourth and its last full attention, the others linear."""
    if arch != 'qwen3_5':
        return ['full_attention'] * layers
    return ['full_attention' if i % 4 == 3 or i == layers - 1 else 'linear_attention' for i in range(layers)]


def price(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``result`` (one arm's, measured or read back from a log) priced by the cost model as it is now: the language
    model's ``bytes_per_token`` at the run's shape and dtype, the tower's ``vision_bytes_per_token`` (from the arm's
    recorded ``vision_shape``) and their ratio, the ``vision_token_cost``."""
    from swift_dynamic_callbacks.policies.pass_cost import bytes_per_token, vision_bytes_per_token, vision_token_cost
    dtype_bytes = 2 if args.dtype == 'bfloat16' else 4
    linear = layer_types(result['arch'], args.layers).count('linear_attention')
    width = (2 * LINEAR['linear_num_key_heads'] * LINEAR['linear_key_head_dim']
             + LINEAR['linear_num_value_heads'] * LINEAR['linear_value_head_dim']) if linear else 0
    per_token = bytes_per_token(hidden=TEXT['hidden_size'], intermediate=TEXT['intermediate_size'],
                                layers=args.layers, vocab=args.vocab, dtype_bytes=dtype_bytes, checkpointing=False,
                                linear_layers=linear, linear_width=width)
    shape = result['vision_shape']
    vision = vision_bytes_per_token(width=shape['width'], intermediate=shape['intermediate'], depth=shape['depth'],
                                    gated=shape['gated'], merge=shape['merge'], out_width=TEXT['hidden_size'],
                                    dtype_bytes=dtype_bytes, checkpointing=False, trained=result['tower'] == 'trained')
    return {**result, 'vision_token_cost': vision_token_cost(vision, per_token), 'bytes_per_token': per_token,
            'vision_bytes_per_token': vision}


def build(arch: str, tower: str, args: argparse.Namespace) -> Any:
    """The model of ``arch`` (``args.layers`` decoder layers, ``args.depth`` vision blocks) with LoRA on the language
    model only (``frozen``) or on every linear layer (``trained``), in training mode."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    text: dict[str, Any] = dict(TEXT, num_hidden_layers=args.layers, vocab_size=args.vocab,
                                max_position_embeddings=32768, tie_word_embeddings=True)
    vision: dict[str, Any] = dict(VISION[arch], depth=args.depth, out_hidden_size=TEXT['hidden_size'])
    if arch == 'qwen2_5_vl':
        text['rope_parameters'] = {'rope_type': 'default', 'mrope_section': [16, 24, 24], 'rope_theta': 1e6}
        vision['fullatt_block_indexes'] = [i for i in range(args.depth) if i % 8 == 7] or [args.depth - 1]
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:  # Qwen3.5: linear attention (Gated DeltaNet), every fourth layer and the last full attention
        text.update(head_dim=128, layer_types=layer_types(arch, args.layers), linear_conv_kernel_dim=4, **LINEAR,
                    rope_parameters={'rope_type': 'default', 'rope_theta': 1e7, 'partial_rotary_factor': 0.25,
                                     'mrope_section': [11, 11, 10], 'mrope_interleaved': True})
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
        model_cls = transformers.Qwen3_5ForConditionalGeneration
    config._attn_implementation = 'sdpa'
    torch.manual_seed(0)
    model = model_cls(config).to(getattr(torch, args.dtype))
    if args.device == 'cuda':
        model = model.cuda()
    targets = 'all-linear' if tower == 'trained' else (
        r'.*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|'
        r'in_proj_b|in_proj_a|out_proj)$')
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05, target_modules=targets))
    model.train()
    return model


def batch(arch: str, name: str, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """One row of ``args.tokens`` tokens holding the pass ``name``'s images and videos (:data:`PASSES`), and its
    media tokens."""
    import torch
    images, videos = PASSES[name]
    patch = VISION[arch]['patch_size']
    channels = 3 * VISION[arch]['temporal_patch_size'] * patch * patch
    seq: list[int] = []
    kinds: list[int] = []
    grids: dict[str, list[list[int]]] = {'image': [], 'video': []}
    for kind, token, items in (('image', IMAGE, [(1, h, w) for h, w in images]), ('video', VIDEO, videos)):
        for t, h, w in items:
            # Qwen3.5 (as Qwen3-VL) marks each temporal patch of a video apart in the text (one group a patch)
            groups = [(1, h, w)] * t if arch == 'qwen3_5' and kind == 'video' else [(t, h, w)]
            grids[kind].append([t, h, w])
            for gt, gh, gw in groups:
                n = gt * gh * gw // 4
                seq += [START] + [token] * n + [END]
                kinds += [0] + [1 if kind == 'image' else 2] * n + [0]
    media = sum(k > 0 for k in kinds)
    filler = torch.randint(0, IMAGE - 1, (args.tokens - len(seq),), generator=torch.Generator().manual_seed(1))
    seq += filler.tolist()
    kinds += [0] * len(filler)
    ids = torch.tensor([seq])
    out: dict[str, Any] = dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids))
    dtype = getattr(torch, args.dtype)
    if arch == 'qwen3_5':
        out['mm_token_type_ids'] = torch.tensor([kinds])
    for kind, values in (('image', 'pixel_values'), ('video', 'pixel_values_videos')):
        if grids[kind]:
            thw = torch.tensor(grids[kind])
            out[values] = torch.randn(int(thw.prod(dim=-1).sum()), channels).to(dtype)
            out[f'{kind}_grid_thw'] = thw
    return out, media


def measure(arch: str, tower: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every pass of :data:`PASSES` on one model (after one unmeasured pass each): its peak bytes, its media tokens,
    and the figures the cost model prices it with."""
    import gc

    from benchmarks.activation_bytes import peak_mode
    from swift_dynamic_callbacks.config.models import vision_shape_of
    model = build(arch, tower, args)
    out: dict[str, Any] = {'arch': arch, 'tower': tower, 'tokens': args.tokens, 'passes': {}}

    import torch
    cuda = args.device == 'cuda'

    def one_pass(inputs: dict[str, Any]) -> None:
        model(**inputs).loss.backward()
        for p in model.parameters():
            p.grad = None

    for name in PASSES:
        inputs, media = batch(arch, name, args)
        if cuda:
            inputs = {k: v.cuda() for k, v in inputs.items()}
        one_pass(inputs)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        mode = peak_mode()(keep=[*model.parameters(), *model.buffers()])
        with mode:
            one_pass(inputs)
        out['passes'][name] = {'media_tokens': media, 'peak_mib': mode.peak / 2**20}
        if cuda:
            torch.cuda.synchronize()
            out['passes'][name]['cuda_peak_mib'] = (torch.cuda.max_memory_allocated() - before) / 2**20
    shape = vision_shape_of(model.base_model.model.config)
    out['vision_shape'] = shape.__dict__
    return price(out, args)


def table(results: list[dict[str, Any]], key: str = 'peak_mib') -> str:
    """Per model and tower, each pass: its media tokens, its measured peak (``key``: the storage counter's, or
    ``cuda_peak_mib``, the CUDA allocator's), the cost model's prediction (its tokens plus its media tokens x the
    vision token cost, at the text pass's measured bytes a token) and its error, and the error of counting its tokens
    alone (the cost model before the vision tower was in it)."""
    lines = ['| model | vision tower | pass | media tokens | measured MiB | vision token cost | predicted MiB | error '
             '| tokens alone: error |', '|---|---|---|---:|---:|---:|---:|---:|---:|']
    for r in results:
        if key not in r['passes']['text']:
            continue
        per_token = r['passes']['text'][key] / r['tokens']
        for name, p in r['passes'].items():
            predicted = (r['tokens'] + p['media_tokens'] * r['vision_token_cost']) * per_token
            alone = r['tokens'] * per_token
            lines.append(f'| {r["arch"]} | {r["tower"]} | {name} | {p["media_tokens"]} | {p[key]:.1f} | '
                         f'{r["vision_token_cost"]:.3f} | {predicted:.1f} | {predicted / p[key] - 1:+.1%} | '
                         f'{alone / p[key] - 1:+.1%} |')
    return '\n'.join(lines)


def token_table(results: list[dict[str, Any]]) -> str:
    """Per model (once), the language model's bytes a token: the text pass's measured, the cost model's
    :func:`~swift_dynamic_callbacks.policies.pass_cost.bytes_per_token`, and their ratio (the scale ``auto``'s
    calibration on a GPU sets; the vision token cost is priced on it)."""
    lines = ['| model | measured MiB a token | bytes_per_token MiB | measured / estimate |', '|---|---:|---:|---:|']
    seen = set()
    for r in results:
        if r['arch'] in seen:
            continue
        seen.add(r['arch'])
        measured, estimate = r['passes']['text']['peak_mib'] / r['tokens'], r['bytes_per_token'] / 2**20
        lines.append(f'| {r["arch"]} | {measured:.4f} | {estimate:.4f} | {measured / estimate:.3f} |')
    return '\n'.join(lines)


def errors(results: list[dict[str, Any]], key: str = 'peak_mib') -> dict[tuple[str, str, str], float]:
    """``(arch, tower, pass) -> predicted / measured - 1`` (as :func:`table` computes it)."""
    out = {}
    for r in results:
        per_token = r['passes']['text'][key] / r['tokens']
        for name, p in r['passes'].items():
            predicted = (r['tokens'] + p['media_tokens'] * r['vision_token_cost']) * per_token
            out[(r['arch'], r['tower'], name)] = predicted / p[key] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--arch', nargs='+', choices=ARCHS, default=list(ARCHS))
    parser.add_argument('--tower', nargs='+', choices=TOWERS, default=list(TOWERS))
    parser.add_argument('--tokens', type=int, default=1024, help='tokens of every pass (one row)')
    parser.add_argument('--layers', type=int, default=2, help='decoder layers')
    parser.add_argument('--depth', type=int, default=2, help='vision blocks')
    parser.add_argument('--vocab', type=int, default=4096)
    parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu',
                        help="cuda: the CUDA allocator's peak is measured beside the storages' (a second table)")
    parser.add_argument('--json', default=None, help='also write the raw figures to this file')
    parser.add_argument('--reprice', default=None, metavar='LOG',
                        help="measure nothing: read a run's '[vision-bytes]' lines from LOG (its output) and print "
                             "its tables priced by the cost model as it is now (give the run's --layers --vocab "
                             "--dtype --tokens)")
    parser.add_argument('--child', nargs=2, metavar=('ARCH', 'TOWER'), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print('[vision-bytes] ' + json.dumps(measure(args.child[0], args.child[1], args)), flush=True)
        return 0
    if args.tokens < 640:
        parser.error(f'--tokens: at least 640 (a pass holds up to 512 media tokens and their markers), got '
                     f'{args.tokens}')
    if args.reprice:
        with open(args.reprice, encoding='utf-8') as f:
            results = [price(json.loads(x.split(' ', 1)[1]), args) for x in f if x.startswith('[vision-bytes] ')]
        return report(results, args)
    from benchmarks.common import machine_lines
    print('\n'.join(machine_lines(sys.argv, args.device)))
    print(f'\nLanguage model: hidden {TEXT["hidden_size"]}, intermediate {TEXT["intermediate_size"]}, {args.layers} '
          f'layers, vocab {args.vocab}; vision towers of {args.depth} blocks at the families\' widths; {args.dtype}; '
          f'one row of {args.tokens} tokens a pass; one process a model\n')
    given = list(argv if argv is not None else sys.argv[1:])
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))}
    results = []
    for arch in args.arch:
        for tower in args.tower:
            done = subprocess.run([sys.executable, '-m', 'benchmarks.vision_bytes', *given, '--child', arch, tower],
                                  capture_output=True, text=True, cwd=ROOT, env=env)
            lines = [x for x in done.stdout.splitlines() if x.startswith('[vision-bytes] ')]
            if done.returncode or not lines:
                print(f'[arm-skipped] {arch}, tower {tower}: failed (rc {done.returncode}): '
                      f'{done.stderr.strip()[-1500:]}', flush=True)
                continue
            results.append(json.loads(lines[-1].split(' ', 1)[1]))
            print(lines[-1], flush=True)
    return report(results, args)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """The tables of ``results`` (the allocator's too where they hold it), and ``--json``."""
    print(table(results))
    if any('cuda_peak_mib' in r['passes']['text'] for r in results):
        print('\nThe CUDA allocator\'s peak (max_memory_allocated over what was allocated before the pass):\n')
        print(table(results, 'cuda_peak_mib'))
    print()
    print(token_table(results))
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
