"""Memory-pressure backoff: smaller forward/backward passes before memory runs out, grow back when it is free."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..config.memory_backoff import MemoryBackoffConfig
from ..device_memory import GIB, CpuProbe, MemoryProbe, auto_probe
from ..policies.memory import PressureState, pressure_step
from ..records import DecisionRecord
from .base import DynamicCallback


class MemoryBackoffCallback(DynamicCallback):
    """Caps the samples of one forward/backward pass under memory pressure and after an OOM; grows back.

    Hooks: ``on_train_begin`` (probe check, the length rules / token budget), ``on_step_begin`` (reset the peak
    counter), ``on_step_end`` (read the probe, agree across ranks, back off or grow back; follow the
    integration's OOM backoff). Flags set: ``new_pass_limit``, ``dynamic_decisions``, ``dynamic_metrics``
    (``dynamic/memory_fraction``, ``dynamic/memory_peak_gib``, ``dynamic/pass_cap``). Reads ``pass_size`` and
    ``oom_event``. State: the cap, clean-step count and pre-backoff size (``PressureState``).
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
        pass_size = max(distributed.gather_objects(int(getattr(control, protocol.PASS_SIZE, 0) or 0)))
        event = getattr(control, protocol.OOM_EVENT, None)
        # an OOM retried at the same one-sample pass leaves the cap as it was (new_cap None): nothing to follow
        ooms = [e for e in distributed.gather_objects((event.new_cap, event.pass_size) if event is not None else None)
                if e is not None and e[0] is not None]
        if ooms:  # the integration already backed off (and agreed); follow it and start counting again
            unlimited = self.state.unlimited if self.state.unlimited is not None else max(p for _, p in ooms)
            self.state = PressureState(cap=min(cap for cap, _ in ooms), clean=0, unlimited=unlimited)
        elif pass_size > 0:
            self.state, action = pressure_step(self.state, fraction, pass_size, high=c.threshold, low=c.low,
                                               clean_steps=c.clean_steps, shrink=c.shrink, grow=c.grow,
                                               minimum=c.min_pass)
            if action is not None:
                limit = {**c.static_limit(), 'samples': self.state.cap}
                protocol.request_pass_limit(control, limit)
                figures = sample.figures()
                figures['fraction'] = round(fraction, 4)
                protocol.record_decision(
                    control,
                    DecisionRecord(self.name, 'pass_limit', action, {
                        'pass_size': pass_size,
                        'new_cap': self.state.cap,
                        **{f'memory_{k}': v for k, v in figures.items()}
                    }, (f'peak memory {fraction:.1%} > {c.threshold:.0%}: at most {self.state.cap} samples a pass'
                        if action == 'backoff' else f'{c.clean_steps} steps below {c.low:.0%}: pass cap '
                        f'{self.state.cap if self.state.cap is not None else "removed"}'), step=state.global_step))
        protocol.publish_metrics(
            control, {
                'dynamic/memory_fraction': round(fraction, 4),
                'dynamic/memory_peak_gib': round(sample.peak / GIB, 4),
                'dynamic/pass_cap': self.state.cap or 0,
            })

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {'pressure': asdict(self.state), 'started': self.started}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = PressureState(**state.get('pressure', {}))
        self.started = bool(state.get('started', False))
