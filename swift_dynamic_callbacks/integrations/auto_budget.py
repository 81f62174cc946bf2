"""``pass_tokens: auto``: the token budget of a pass from the device's free memory, what the run will still hold,
and the model's shape.

The budget is read once, at the first step boundary: the model is loaded, but the gradients and the optimizer's
states are not allocated yet (the first backward and the first optimizer step create them). A full fine-tune holds
a gradient per trainable weight and, for Adam, two moments: on a 7B model in bf16 about 14 GB and 28 GB that a
reading of free memory at that moment leaves out. :func:`held_later` counts them; the budget is what is left per
token (:func:`~..policies.pass_cost.bytes_per_token` in the *compute* dtype, with a MoE's active experts).
"""

from __future__ import annotations

from typing import Any, Callable

#: ``pass_tokens: auto`` on a CPU: a larger pass gains nothing there (compute-bound), so at most this
CPU_MAX_PASS_TOKENS = 8192
#: when the model's shape cannot be read: the budget by device memory (the README's hand-set table)
FALLBACK = ((100 * 2**30, 16384), (0, 8192))


def _available_cpu_bytes() -> int:
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def optimizer_states(optimizer: Any) -> tuple[int, int | None]:
    """``(states per trainable weight, bytes per state or None: the weight's own)`` of ``optimizer`` (by its class
    name: Adam-family 2, 8-bit Adam 2 of 1 byte, SGD 1 with momentum else 0, Adafactor about 0, anything else 2:
    the conservative guess)."""
    name = type(optimizer).__name__.lower() if optimizer is not None else 'adamw'
    wrapped = getattr(optimizer, 'optimizer', None)  # accelerate's AcceleratedOptimizer
    if wrapped is not None and 'accelerated' in name:
        name = type(wrapped).__name__.lower()
        optimizer = wrapped
    if 'adafactor' in name:
        return 0, None
    if '8bit' in name:
        return 2, 1
    if 'sgd' in name:
        groups = getattr(optimizer, 'param_groups', None) or [{}]
        return int(any(g.get('momentum', 0) for g in groups)), None
    return 2, None


def held_later(model: Any, optimizer: Any) -> dict[str, int]:
    """Bytes the run will hold that are not allocated yet: a gradient for every trainable weight without one, and
    the optimizer's states for every trainable weight it has none for yet."""
    grads = states = 0
    per_weight, state_bytes = optimizer_states(optimizer)
    state = getattr(getattr(optimizer, 'optimizer', optimizer), 'state', {}) if optimizer is not None else {}
    trainable = 0
    for p in model.parameters() if hasattr(model, 'parameters') else ():
        if not p.requires_grad:
            continue
        n = int(getattr(p, 'ds_numel', 0) or p.numel())  # ZeRO-3 keeps an empty tensor and the full count apart
        trainable += n
        if p.grad is None:
            grads += n * p.element_size()
        if not state.get(p):
            states += per_weight * n * (state_bytes or p.element_size())
    return {'trainable_params': trainable, 'grad_bytes': grads, 'optimizer_bytes': states}


def compute_dtype_bytes(model: Any, args: Any, autocast: bool | None = None) -> int:
    """Bytes of an activation: 2 where a 16-bit autocast runs the passes, else the dtype the weights have.

    ``autocast``: whether the trainer's accelerator runs the passes under autocast (accelerate's ``native_amp``: not
    for ``fp16`` on a CPU, nor under DeepSpeed, which casts the weights themselves); ``None`` (unknown): ``bf16`` /
    ``fp16`` in ``args`` are taken to mean it. Without autocast: the dtype most of the model's floating-point weights
    have now (ms-swift's ``fp16: true`` beside a float32 model on a CPU computes in float32; a 4-bit model's packed
    weights are not floating point), else its configured dtype."""
    import torch
    if autocast or (autocast is None and (getattr(args, 'bf16', False) or getattr(args, 'fp16', False))):
        return 2
    counts: dict[int, int] = {}
    for p in model.parameters() if hasattr(model, 'parameters') else ():
        if p.is_floating_point():
            n = int(getattr(p, 'ds_numel', 0) or p.numel())  # ZeRO-3 keeps an empty tensor and the full count apart
            counts[p.element_size()] = counts.get(p.element_size(), 0) + n
    if counts:
        return max(counts, key=counts.get)
    config = getattr(model, 'config', None)
    dtype = getattr(config, 'dtype', None) or getattr(config, 'torch_dtype', None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return torch.empty((), dtype=dtype).element_size()
    return 2


def model_shape(model: Any) -> dict[str, Any]:
    """hidden, intermediate (a MoE's: the active experts' and the shared expert's), layers, vocabulary, whether it is
    a MoE, and its linear-attention layers and their width (``2 x keys + values``; Qwen3.5's Gated DeltaNet)."""
    config = getattr(model, 'config', None)
    config = getattr(config, 'text_config', None) or config
    shape = {k: getattr(config, k, None) for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers',
                                                    'vocab_size')}
    types = [str(t) for t in getattr(config, 'layer_types', None) or ()]
    shape['linear_layers'] = types.count('linear_attention')
    keys = (getattr(config, 'linear_num_key_heads', 0) or 0) * (getattr(config, 'linear_key_head_dim', 0) or 0)
    values = (getattr(config, 'linear_num_value_heads', 0) or 0) * (getattr(config, 'linear_value_head_dim', 0) or 0)
    shape['linear_width'] = int(2 * keys + values) if shape['linear_layers'] else 0
    experts = getattr(config, 'num_experts_per_tok', None)
    expert_size = getattr(config, 'moe_intermediate_size', None)
    shape['moe'] = bool(experts and expert_size)
    if shape['moe']:
        shape['intermediate_size'] = int(experts) * int(expert_size) + int(
            getattr(config, 'shared_expert_intermediate_size', 0) or 0)
    return shape


def model_bytes_per_token(shape: dict[str, Any], dtype_bytes: int, checkpointing: bool) -> int:
    """:func:`~..policies.pass_cost.bytes_per_token` of a model's shape (:func:`model_shape`) in the compute dtype."""
    from ..policies.pass_cost import bytes_per_token
    return bytes_per_token(hidden=shape['hidden_size'], intermediate=shape['intermediate_size'],
                           layers=shape['num_hidden_layers'], vocab=shape['vocab_size'], dtype_bytes=dtype_bytes,
                           checkpointing=checkpointing, linear_layers=shape['linear_layers'],
                           linear_width=shape['linear_width'])


def resolve_auto_pass_tokens(model: Any, device: Any, *, checkpointing: bool, cpu_budget_gib: float | None = None,
                             optimizer: Any = None, args: Any = None,
                             held: Callable[[dict[str, int]], dict[str, int]] | None = None,
                             activation_factor: float = 1.0,
                             autocast: bool | None = None) -> tuple[int, dict[str, Any]]:
    """``pass_tokens: auto`` on this rank: the budget and the figures it came from (for the record).

    On CUDA the free memory now (the model loaded), on a CPU ``cpu_budget_gib`` (``memory_backoff``'s) or half the
    available memory; less what the run will hold that is not allocated yet (:func:`held_later`: gradients and
    optimizer states, which decide a full fine-tune; ``held``: this rank's part of them under a sharded engine,
    ``Engine.held_bytes``); a margin of 10 %; at :func:`~..policies.pass_cost.bytes_per_token` of the model's shape
    in the compute dtype, times ``activation_factor`` (what the engine holds a token beyond it:
    ``Engine.activation_factor``, ZeRO-3's; ``autocast``: whether the passes run under a 16-bit autocast,
    :func:`compute_dtype_bytes`). On a CPU at most :data:`CPU_MAX_PASS_TOKENS`. A model whose shape cannot be read
    takes the hand-set table by device memory."""
    import torch

    from ..policies.pass_cost import auto_pass_tokens
    cuda = getattr(device, 'type', str(device)) == 'cuda' and torch.cuda.is_available()
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
    else:
        total = free = int(cpu_budget_gib * 2**30) if cpu_budget_gib else _available_cpu_bytes() // 2
    shape = model_shape(model)
    dims = {k: shape[k] for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'vocab_size')}
    later = held_later(model, optimizer)
    if held is not None:
        later = held(later)
    left = max(0, free - later['grad_bytes'] - later['optimizer_bytes'])
    dtype_bytes = compute_dtype_bytes(model, args, autocast)
    figures: dict[str, Any] = {'device': 'cuda' if cuda else 'cpu', 'free_gib': round(free / 2**30, 3),
                               'total_gib': round(total / 2**30, 3), **shape, 'dtype_bytes': dtype_bytes,
                               'gradient_checkpointing': checkpointing,
                               'trainable_params': later['trainable_params'],
                               'grad_gib': round(later['grad_bytes'] / 2**30, 3),
                               'optimizer_gib': round(later['optimizer_bytes'] / 2**30, 3),
                               'left_gib': round(left / 2**30, 3)}
    if not all(isinstance(v, int) and v > 0 for v in dims.values()):
        tokens = next(t for memory, t in FALLBACK if total >= memory)
        figures.update(how='fallback: the model\'s shape is unknown; the budget by device memory')
        return (min(tokens, CPU_MAX_PASS_TOKENS) if not cuda else tokens), figures
    per_token = int(model_bytes_per_token(shape, dtype_bytes, checkpointing) * activation_factor)
    multiple = 256 if cuda else 16  # a kernel-friendly size on a GPU; on a CPU only the memory counts
    tokens = auto_pass_tokens(left, per_token, multiple=multiple, minimum=multiple,
                              maximum=131072 if cuda else CPU_MAX_PASS_TOKENS)
    figures.update(bytes_per_token=per_token, engine_activation_factor=activation_factor, margin=0.1,
                   how='(free memory - gradients and optimizer states not allocated yet) x 0.9 / bytes a token '
                       '(model shape, compute dtype' + (f', x {activation_factor:g} under this engine)'
                                                       if activation_factor != 1.0 else ')'))
    return tokens, figures


def agreed_auto_pass_tokens(trainer: Any, engine: Any, *, cpu_budget_gib: float | None = None,
                            setting: str = 'pass_tokens') -> tuple[int, Any]:
    """A ``pass_tokens: auto`` budget every rank agrees on: each rank's from its free memory and the model's shape
    (:func:`resolve_auto_pass_tokens`, with the engine adapter's share of gradients and optimizer states and its
    activation factor), the smallest over the ranks (collective). Returns it and its ``pass_tokens`` record (reason
    ``auto``; ``setting``: the setting it answers, ``pass_tokens`` or ``grpo_pass_tokens``)."""
    from .. import distributed
    from ..records import DecisionRecord
    tokens, figures = resolve_auto_pass_tokens(
        trainer.model, trainer.args.device, checkpointing=bool(trainer.args.gradient_checkpointing),
        cpu_budget_gib=cpu_budget_gib, optimizer=getattr(trainer, 'optimizer', None), args=trainer.args,
        held=lambda later: engine.held_bytes(trainer, later), activation_factor=engine.activation_factor(trainer),
        autocast=getattr(getattr(trainer, 'accelerator', None), 'native_amp', None))
    chosen = min(distributed.gather_objects(tokens))
    record = DecisionRecord(
        'integration', 'pass_tokens', 'auto', {'setting': setting, 'pass_tokens': chosen, 'rank_pass_tokens': tokens,
                                               **figures},
        f'{setting}: auto -> {chosen} tokens a pass ({figures["how"]}; {figures["free_gib"]} GiB free on '
        f'{figures["device"]})')
    return chosen, record


def vision_tower(model: Any) -> Any:
    """The vision tower of a vision-language model (a Qwen-VL model's ``visual`` module, InternVL's ``vision_tower``,
    under any wrapper), else ``None``."""
    for name, module in model.named_modules() if hasattr(model, 'named_modules') else ():
        if name.rsplit('.', 1)[-1] in ('visual', 'vision_tower'):
            return module
    return None


def vision_cost(model: Any, args: Any = None) -> tuple[float, int, dict[str, Any]]:
    """What one image (video) token's work in the model's vision tower costs in tokens of the pass cost model
    (:func:`~..policies.pass_cost.vision_token_cost`; ``0.0``: no tower the cost model knows,
    :func:`~..config.models.vision_shape_of`), the patches merged into a token, and the figures for the record: the
    cost, whether the tower trains (any of its weights, a LoRA adapter's included, requires a gradient) and whether it
    recomputes its blocks (its ``gradient_checkpointing``)."""
    from ..config.models import vision_shape_of
    from ..policies.pass_cost import vision_bytes_per_token, vision_token_cost
    shape = vision_shape_of(getattr(model, 'config', None))
    tower = vision_tower(model)
    dims = model_shape(model)
    if shape is None or tower is None or not all(isinstance(dims[k], int) and dims[k] > 0 for k in (
            'hidden_size', 'intermediate_size', 'num_hidden_layers', 'vocab_size')):
        return 0.0, 1, {}
    dtype_bytes = compute_dtype_bytes(model, args)
    trained = any(p.requires_grad for p in tower.parameters())
    checkpointing = bool(getattr(tower, 'gradient_checkpointing', False))
    per_token = model_bytes_per_token(dims, dtype_bytes, bool(getattr(args, 'gradient_checkpointing', False)))
    vision = vision_bytes_per_token(width=shape.width, intermediate=shape.intermediate, depth=shape.depth,
                                    gated=shape.gated, merge=shape.merge, out_width=dims['hidden_size'],
                                    dtype_bytes=dtype_bytes, checkpointing=checkpointing, trained=trained)
    cost = vision_token_cost(vision, per_token)
    return cost, shape.merge, {'vision_token_cost': round(cost, 4), 'vision_trained': trained,
                               'vision_checkpointing': checkpointing}
