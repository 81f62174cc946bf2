"""``pass_tokens: auto``: the token budget of a pass from the device's free memory and the model's shape."""

from __future__ import annotations

from typing import Any

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


def resolve_auto_pass_tokens(model: Any, device: Any, *, checkpointing: bool,
                             cpu_budget_gib: float | None = None) -> tuple[int, dict[str, Any]]:
    """``pass_tokens: auto`` on this rank: the budget and the figures it came from (for the record). On CUDA the free
    memory now (the model loaded) against :func:`~..policies.pass_cost.bytes_per_token` of the model's shape; on
    a CPU ``cpu_budget_gib`` (``memory_backoff``'s) or half the available memory, at most
    :data:`CPU_MAX_PASS_TOKENS`. A model whose shape cannot be read takes the hand-set table by device memory."""
    import torch

    from ..policies.pass_cost import auto_pass_tokens, bytes_per_token
    cuda = getattr(device, 'type', str(device)) == 'cuda' and torch.cuda.is_available()
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
    else:
        total = free = int(cpu_budget_gib * 2**30) if cpu_budget_gib else _available_cpu_bytes() // 2
    config = getattr(model, 'config', None)
    config = getattr(config, 'text_config', None) or config
    shape = {k: getattr(config, k, None) for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers',
                                                    'vocab_size')}
    params = next(iter(model.parameters()), None) if hasattr(model, 'parameters') else None
    dtype_bytes = params.element_size() if params is not None else 2
    figures: dict[str, Any] = {'device': 'cuda' if cuda else 'cpu', 'free_gib': round(free / 2**30, 3),
                               'total_gib': round(total / 2**30, 3), **shape, 'dtype_bytes': dtype_bytes,
                               'gradient_checkpointing': checkpointing}
    if not all(isinstance(v, int) and v > 0 for v in shape.values()):
        tokens = next(t for memory, t in FALLBACK if total >= memory)
        figures.update(how='fallback: the model\'s shape is unknown; the budget by device memory')
        return (min(tokens, CPU_MAX_PASS_TOKENS) if not cuda else tokens), figures
    per_token = bytes_per_token(hidden=shape['hidden_size'], intermediate=shape['intermediate_size'],
                                layers=shape['num_hidden_layers'], vocab=shape['vocab_size'], dtype_bytes=dtype_bytes,
                                checkpointing=checkpointing)
    tokens = auto_pass_tokens(free, per_token, maximum=131072 if cuda else CPU_MAX_PASS_TOKENS)
    figures.update(bytes_per_token=per_token, margin=0.1, how='free memory x 0.9 / bytes a token (model shape)')
    return tokens, figures
