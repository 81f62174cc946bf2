"""Settings of the ``memory_backoff`` callback (YAML key ``dynamic_callbacks.memory_backoff``); no torch imported."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from . import Choice, ConfigError, Int, IntTable, Number, Reads, Settings, setting


@dataclass(frozen=True)
class MemoryBackoffConfig(Settings):
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
        pass_tokens_cap: at most this many tokens a pass, priced as the planner prices one (padded ``rows x
            longest``, the sum when packed: ``policies/pass_cost.py``); under ``length_batching.pass_tokens`` the
            passes are also planned within it. Called ``max_pass_tokens`` before (still read, with a note).
        probe: ``auto`` (CUDA, XPU or MPS when present, else CPU), ``cuda`` or ``cpu``.
        cpu_budget_gib: the CPU probe's budget for the process RSS (required with ``probe: cpu``, and with
            ``auto`` when training runs on the CPU: without it there is no fraction to compare). Not read by
            ``probe: cuda``.

    The global batch never changes: a smaller pass means more passes per micro-batch, with the same samples and
    loss normalisation (``new_pass_limit``).
    """

    threshold: float = setting(Number(0, 1, low_open=True, high_open=True), 0.85)
    low: float = setting(Number(0, 1, low_open=True, high_open=True), 0.6)
    clean_steps: int = setting(Int(1), 50)
    shrink: float = setting(Number(0, 1, low_open=True, high_open=True), 0.5)
    grow: float = setting(Number(1, 8, low_open=True), 2.0)
    min_pass: int = setting(Int(1), 1)
    length_rules: Mapping[int, int] = setting(IntTable(1, what='longer_than: samples'), default_factory=dict)
    pass_tokens_cap: int | None = setting(Int(1, optional=True), None)
    probe: str = setting(Choice(('auto', 'cuda', 'cpu')), 'auto')
    cpu_budget_gib: float | None = setting(Number(0, math.inf, low_open=True, high_open=True, optional=True), None)

    renamed = {'max_pass_tokens': 'pass_tokens_cap'}
    reads = (Reads('probe', {'auto': ('cpu_budget_gib', ), 'cpu': ('cpu_budget_gib', ), 'cuda': ()}), )
    controls = ('pass_limit', )

    def cross_checks(self) -> None:
        if self.low >= self.threshold:
            raise ConfigError(f'low: must be below threshold ({self.threshold}), got {self.low}')
        if self.probe == 'cpu' and self.cpu_budget_gib is None:
            raise ConfigError('cpu_budget_gib: probe: cpu compares the process RSS with a budget; set cpu_budget_gib '
                              '(e.g. 16), got null')

    def static_limit(self) -> dict[str, Any]:
        return {
            'samples': None,
            'tokens': self.pass_tokens_cap,
            'rules': [[k, v] for k, v in sorted(self.length_rules.items())]
        }
