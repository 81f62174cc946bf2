"""The token budget of a pass under ``pass_tokens`` after OOMs: agreed at every step boundary, planned at.

Under ``length_batching.pass_tokens`` a pass is sized by tokens, so an OOM says a pass of that many *tokens* did not
fit, whatever its rows. At each step boundary, from every rank's OOM records of the step that ended (the same list on
every rank: ``requests.agree_step`` exchanges them), :class:`PassBudget` folds the smallest failed pass's cost into
:class:`~..policies.pass_cost.TokenBudget` (lower after an OOM, halfway back after clean steps), so every rank holds
the same budget; the coordinator then plans the steps from this one on at it (``ElasticDataLoader.set_pass_budget``)
and the step runner cuts no pass above it. A one-off OOM costs a few steps of smaller passes; a real memory end settles
just below the smallest pass that failed.

State (saved with the integration's): the :class:`~..policies.pass_cost.TokenBudget`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Mapping

from ..policies.pass_cost import TokenBudget, budget_after_oom, budget_after_step
from ..records import DecisionRecord


class PassBudget:
    """The agreed token budget of a pass (``budget`` ``None``: the plan's ``pass_tokens``).

    Args:
        grow_after: clean steps before the budget grows (``integration.oom_grow_back_steps``; 0: never).
        forget_after: settled clean steps before a failure is forgotten (``integration.oom_forget_steps``; 0: never).
    """

    def __init__(self, grow_after: int = 2, forget_after: int = 32) -> None:
        self.grow_after = grow_after
        self.forget_after = forget_after
        self.state = TokenBudget()

    @property
    def budget(self) -> int | None:
        return self.state.budget

    def at_boundary(self, ooms: Iterable[DecisionRecord], ceiling: int | None, step: int) -> DecisionRecord | None:
        """Fold the step that ended in (``ooms``: every rank's OOM records of it; ``ceiling``: the plan's
        ``pass_tokens``, ``None`` when passes are not cut by tokens). Returns a ``pass_budget`` record when the budget
        changed."""
        if ceiling is None:
            self.state = TokenBudget()
            return None
        old = self.state
        failed = [int(r.values['pass_tokens']) for r in ooms if r.values.get('pass_tokens')]
        if failed:
            self.state = budget_after_oom(old, min(failed), ceiling)
            action = 'oom'
        else:
            self.state = budget_after_step(old, ceiling, grow_after=self.grow_after, forget_after=self.forget_after)
            action = 'grow_back' if (self.state.budget or ceiling) > (old.budget or ceiling) else 'forget'
        if self.state.budget == old.budget:
            return None
        new = self.state.budget if self.state.budget is not None else ceiling
        values = {'old': old.budget if old.budget is not None else ceiling, 'new': new, 'pass_tokens': ceiling,
                  'failed_pass_tokens': min(failed) if failed else None, 'good': self.state.good,
                  'bad': self.state.bad}
        if action == 'oom':
            message = (f'out of memory in a pass of {min(failed)} tokens: passes planned within {new} tokens from '
                       'this step on (rows not capped)')
        else:
            message = (f'{self.grow_after} clean steps: passes planned within {new} tokens' +
                       (' (the plan\'s pass_tokens)' if self.state.budget is None else
                        f' (halfway to the smallest failed pass, {self.state.bad})'))
        return DecisionRecord('integration', 'pass_budget', action, values, message, step=step)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        self.state = TokenBudget(**(state or {}))


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
