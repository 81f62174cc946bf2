"""Memory-pressure backoff: smaller forward/backward passes before memory runs out, grow back when it is free."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..config.memory_backoff import MemoryBackoffConfig
from ..device_memory import GIB, CpuProbe, MemoryProbe, auto_probe
from ..policies.memory import PressureState, pressure_step
from ..records import DecisionRecord
from .base import DynamicCallback


class MemoryBackoffCallback(DynamicCallback):
    """Caps one forward/backward pass under memory pressure and after an OOM; grows back.

    What is capped follows what memory follows: the pass's *samples* (``pass_size``), or, where the integration
    cuts passes by a token budget (``length_batching.pass_tokens``: ``pass_cost`` > 0), its *tokens* — there a pass
    of two long rows and one of sixty-four short ones cost the same memory, and a row cap would ratchet down to one
    row a pass without moving the peak. A token cap never cuts a pass below one row, so one row a pass happens only
    where one row is all that fits.

    Hooks: ``on_train_begin`` (probe check, the length rules / token budget), ``on_step_begin`` (reset the peak
    counter), ``on_step_end`` (read the probe, agree across ranks, back off or grow back; after an OOM the
    integration lowers its own pass budget, grown back by it, and this callback's count of clean steps restarts).
    Flags set: ``new_pass_limit`` (``samples``, or ``tokens``),
    ``dynamic_decisions``, ``dynamic_metrics`` (``dynamic/memory_fraction``, ``dynamic/memory_peak_gib``,
    ``dynamic/pass_cap``: samples or tokens, ``dynamic/pass_cap_unit``: 0 samples, 1 tokens). Reads ``pass_size``,
    ``pass_cost`` and ``oom_event``. State: the cap, clean-step count, pre-backoff size and unit
    (``PressureState``).
    """

    name = 'memory_backoff'
    config_class = MemoryBackoffConfig

    def __init__(self, config: MemoryBackoffConfig | None = None, probe: MemoryProbe | None = None) -> None:
        super().__init__(config)
        self.probe = probe
        self.state = PressureState()
        self.started = False

    # ---- hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        c = self.config
        if self.probe is None:
            budget = int((c.cpu_budget_gib or 0) * GIB)
            self.probe = CpuProbe(budget) if c.probe == 'cpu' else auto_probe(budget)
            if c.probe == 'cuda' and self.probe.name != 'cuda':
                raise ConfigError('dynamic_callbacks.memory_backoff.probe: cuda, but no CUDA device is available')
        if self.probe.name == 'cpu' and not self.probe.budget:
            raise ConfigError('dynamic_callbacks.memory_backoff.cpu_budget_gib: training runs on the CPU, so memory '
                              'pressure is the process RSS against a budget; set cpu_budget_gib (e.g. 16), or remove '
                              'memory_backoff (OOM recovery is the integration\'s and stays on)')
        if not self.started:
            self.started = True
            static = c.static_limit()
            if static['tokens'] is not None or static['rules']:
                protocol.request_pass_limit(control, static)
                protocol.record_decision(
                    control,
                    DecisionRecord(self.name, 'pass_limit', 'length_rules', static,
                                   'passes capped by the longest sequence / a token budget', step=state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self.probe.reset_peak()

    def on_step_end(self, args, state, control, **kwargs):
        c = self.config
        sample = self.probe.read()
        fractions = distributed.gather_objects(sample.fraction)
        fraction = max(fractions)
        sizes = distributed.gather_objects((int(getattr(control, protocol.PASS_SIZE, 0) or 0),
                                            int(getattr(control, protocol.PASS_COST, 0) or 0)))
        unit = 'tokens' if any(cost for _, cost in sizes) else 'samples'
        pass_size = max(cost if unit == 'tokens' else size for size, cost in sizes)
        if unit != self.state.unit:  # passes are now cut by tokens (or no longer): the cap's unit changed
            self.state = PressureState(unit=unit)
        event = getattr(control, protocol.OOM_EVENT, None)
        events = [e for e in distributed.gather_objects((event.new_cap, event.pass_size) if event is not None else None)
                  if e is not None]
        if events:  # the integration lowered its own pass budget (and grows it back): not a clean step here
            self.state = replace(self.state, clean=0)
        elif pass_size > 0:
            self.state, action = pressure_step(self.state, fraction, pass_size, high=c.threshold, low=c.low,
                                               clean_steps=c.clean_steps, shrink=c.shrink, grow=c.grow,
                                               minimum=c.min_pass if unit == 'samples' else 1)
            if action is not None:
                limit = dict(c.static_limit())
                if unit == 'samples':
                    limit['samples'] = self.state.cap
                elif self.state.cap is not None:
                    limit['tokens'] = min(t for t in (limit['tokens'], self.state.cap) if t is not None)
                protocol.request_pass_limit(control, limit)
                figures = sample.figures()
                figures['fraction'] = round(fraction, 4)
                protocol.record_decision(
                    control,
                    DecisionRecord(self.name, 'pass_limit', action, {
                        'pass_size': pass_size,
                        'new_cap': self.state.cap,
                        'unit': unit,
                        **{f'memory_{k}': v for k, v in figures.items()}
                    }, (f'peak memory {fraction:.1%} > {c.threshold:.0%}: at most {self.state.cap} {unit} a pass'
                        if action == 'backoff' else f'{c.clean_steps} steps below {c.low:.0%}: pass cap '
                        f'{self.state.cap if self.state.cap is not None else "removed"}'), step=state.global_step))
        protocol.publish_metrics(
            control, {
                'dynamic/memory_fraction': round(fraction, 4),
                'dynamic/memory_peak_gib': round(sample.peak / GIB, 4),
                'dynamic/pass_cap': self.state.cap or 0,
                'dynamic/pass_cap_unit': int(unit == 'tokens'),
            })

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {'pressure': asdict(self.state), 'started': self.started}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = PressureState(**state.get('pressure', {}))
        self.started = bool(state.get('started', False))
