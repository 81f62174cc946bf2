"""Memory-pressure backoff: smaller forward/backward passes before memory runs out, grow back when it is free."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError, check_choice, check_int, check_number
from ..memory import GIB, CpuProbe, MemoryProbe, auto_probe
from ..policies.memory import PressureState, pressure_step
from ..records import DecisionRecord
from .base import DynamicCallback
from .batch_schedule import _int_table


@dataclass(frozen=True)
class MemoryBackoffConfig:
    """Settings of :class:`MemoryBackoffCallback` (YAML key ``dynamic_callbacks.memory_backoff``).

    Attributes:
        threshold: peak memory fraction of the device above which the next steps run in smaller passes (default
            0.85, the seed's).
        low: the fraction below which a step counts as clean (hysteresis: between ``low`` and ``threshold`` the
            size holds). Default 0.6.
        clean_steps: clean steps in a row before growing back. Default 50.
        shrink: the pass size is multiplied by this on pressure (default 0.5).
        grow: and by this on a grow-back (default 2.0), until the size from before the first backoff.
        min_pass: never fewer samples per pass than this (default 1).
        length_rules: ``{longer_than: samples}``: a micro-batch whose padded length is greater than
            ``longer_than`` tokens runs at most ``samples`` samples a pass (seed: ``{1024: 2}``).
        max_pass_tokens: at most this many padded tokens (samples x padded length) per pass.
        probe: ``auto`` (CUDA, XPU or MPS when present, else CPU), ``cuda`` or ``cpu``.
        cpu_budget_gib: the CPU probe's budget for the process RSS (required when the CPU probe is used for
            pressure: without it there is no fraction to compare).

    The global batch never changes: a smaller pass means more passes per micro-batch, with the same samples and
    loss normalisation (``new_pass_limit``).
    """

    threshold: float = 0.85
    low: float = 0.6
    clean_steps: int = 50
    shrink: float = 0.5
    grow: float = 2.0
    min_pass: int = 1
    length_rules: Mapping[int, int] = field(default_factory=dict)
    max_pass_tokens: int | None = None
    probe: str = 'auto'
    cpu_budget_gib: float | None = None

    def __post_init__(self) -> None:
        check_number('threshold', self.threshold, 0, 1, low_open=True, high_open=True)
        check_number('low', self.low, 0, 1, low_open=True, high_open=True)
        if self.low >= self.threshold:
            raise ConfigError(f'low: must be below threshold ({self.threshold}), got {self.low}')
        check_int('clean_steps', self.clean_steps, minimum=1)
        check_number('shrink', self.shrink, 0, 1, low_open=True, high_open=True)
        check_number('grow', self.grow, 1, 8, low_open=True)
        check_int('min_pass', self.min_pass, minimum=1)
        object.__setattr__(self, 'length_rules', _int_table('length_rules', self.length_rules, 1))
        if self.max_pass_tokens is not None:
            check_int('max_pass_tokens', self.max_pass_tokens, minimum=1)
        check_choice('probe', self.probe, ('auto', 'cuda', 'cpu'))
        if self.cpu_budget_gib is not None:
            check_number('cpu_budget_gib', self.cpu_budget_gib, 0, math.inf, low_open=True, high_open=True)

    def static_limit(self) -> dict[str, Any]:
        return {
            'samples': None,
            'tokens': self.max_pass_tokens,
            'rules': [[k, v] for k, v in sorted(self.length_rules.items())]
        }


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
        ooms = [e for e in distributed.gather_objects((event.new_cap, event.pass_size) if event is not None else None)
                if e is not None]
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
