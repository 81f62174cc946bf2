"""Settings of the ``batch_growth`` callback (YAML key ``dynamic_callbacks.batch_growth``); no torch imported."""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import (Check, Choice, ConfigError, Int, IntTable, Number, Reads, Settings, setting)

POLICIES = ('interval', 'table', 'callable', 'loss_variability', 'noise_scale', 'seesaw', 'late_switch')
#: Modules the command line never imports (they cost seconds): a ``function`` whose module needs one of them is
#: checked when the trainer is built, in the training process, instead of by ``swift-dynamic check``.
HEAVY_MODULES = ('torch', 'transformers', 'peft', 'swift', 'accelerate', 'deepspeed')


class HeavyImportNeeded(ImportError):
    """Importing a ``function`` module would import torch (or another heavy package) in a light process."""


class _HeavyBlocker(importlib.abc.MetaPathFinder):

    def find_spec(self, name, path=None, target=None):  # noqa: D102 - importlib protocol
        if name.split('.')[0] in HEAVY_MODULES:
            raise HeavyImportNeeded(name)
        return None


def _split_path(path: str) -> tuple[str, str]:
    module, _, name = path.partition(':') if ':' in path else path.rpartition('.')
    if not module or not name:
        raise ConfigError(f'function: expected "package.module:function", got {path!r}')
    return module, name


def import_callable(path: str, *, light: bool = False) -> Callable[[int, int], int] | None:
    """``'package.module:function'`` or ``'package.module.function'`` -> the function.

    ``light``: in a process that has not imported torch (the command line), a module that would import one of
    :data:`HEAVY_MODULES` is not imported (what it had imported so far is dropped again) and ``None`` is
    returned: the training process checks it when the trainer is built.

    Raises:
        ConfigError: bad syntax, the module or the attribute cannot be imported, or it is not callable.
    """
    module, name = _split_path(path)
    blocker = None
    before = set(sys.modules)
    if light and not any(m in sys.modules for m in HEAVY_MODULES):
        blocker = _HeavyBlocker()
        sys.meta_path.insert(0, blocker)
    try:
        fn = getattr(importlib.import_module(module), name)
    except HeavyImportNeeded:
        for added in set(sys.modules) - before:
            sys.modules.pop(added, None)
        return None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f'function: cannot import {path!r}: {type(e).__name__}: {e}') from None
    except Exception as e:  # noqa: BLE001 - the module itself failed while being imported
        raise ConfigError(f'function: importing {path!r} failed: {type(e).__name__}: {e}') from None
    finally:
        if blocker is not None:
            sys.meta_path.remove(blocker)
    if not callable(fn):
        raise ConfigError(f'function: {path!r} is not callable (got a {type(fn).__name__})')
    return fn


def checked_size(value: Any, where: str) -> int:
    """A batch size returned by the ``function``; ``ValueError`` naming the call unless an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'batch_growth.function returned {value!r} {where}; it must return an int >= 1')
    return value


@dataclass(frozen=True)
class FunctionRef(Check):
    """A dotted path ``package.module:function`` (syntax checked here; the import in ``cross_checks``) or, in
    Python, the callable itself."""

    optional: bool = True

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, str):
            try:
                _split_path(value)
            except ConfigError as e:
                raise ConfigError(str(e).replace('function:', f'{name}:', 1)) from None
            return value
        if callable(value) and not isinstance(value, type):
            return value
        raise ConfigError(f'{name}: expected "package.module:function" (or a callable in Python), got {value!r}')


@dataclass(frozen=True)
class BatchGrowthConfig(Settings):
    """Settings of :class:`BatchGrowthCallback` (YAML key ``dynamic_callbacks.batch_growth``).

    Attributes:
        policy: ``interval`` (grow by ``factor`` every ``interval`` steps), ``table`` (``{step: size}``),
            ``callable`` (``function(step, batch_size) -> batch_size``, called after every optimizer step) or
            ``loss_variability`` (every ``interval`` steps, grow by ``factor`` while the coefficient of variation
            of the last ``window`` logged training losses is above ``threshold``) or ``noise_scale`` (every
            ``interval`` steps, grow toward the critical batch size estimated from the gradient noise scale, see
            below) or ``seesaw`` (Seesaw, arXiv 2510.14717: whenever the LR schedule has cut the LR by another
            ``factor`` since its peak, grow the batch by ``factor`` and cut the LR by only ``sqrt(factor)``, up to
            ``maximum``; needs ``lr_scaling: sqrt``; see ``policies.growth.seesaw_size``) or ``late_switch`` (arXiv
            2602.14208: ``initial`` until ``switch_at`` of the run's optimizer steps, or earlier when the loss
            plateaus (``switch_patience``), then ``maximum``; ``policies.growth.late_switch_size``).
        initial: per-device batch size at the start (and before the first ``table`` key).
        factor: growth factor, in (1, 8]; fractional factors round up and every growth adds >= 1. For
            ``seesaw`` it is also the LR cut (``alpha``) that triggers one growth.
        interval: optimizer steps between growths (interval policy) or between checks (loss_variability,
            noise_scale).
        maximum: largest per-device batch size (all policies are clamped to it).
        delay: optimizer steps before the interval schedule starts (first growth at ``delay + interval``).
        table: ``{0-based optimizer step: per-device batch size}`` (table policy), or with ``table_unit: samples``
            ``{samples consumed: per-device batch size}``.
        table_unit: ``steps`` (default: the table's keys are optimizer steps) or ``samples``: the keys are the samples
            consumed before the step (all ranks together; counted from the batch sizes in effect, ``batch x GA x
            processes`` a step), so stages are written by data (``{0: 1, 32: 2, 64: 4}``: a per-device batch of 2
            from the 33rd sample on) and stay at the same samples when GA or the process count changes at a resume.
        function: dotted path ``package.module:function`` (or the function itself, in Python). Imported and called
            once as ``function(0, initial)`` when the settings are validated; ``swift-dynamic check`` does that
            only when the module can be imported without torch (else the training process does it when the
            trainer is built, and ``check`` prints a note saying so).
        micro_batch_cap: largest number of samples per forward/backward pass; a larger batch is run as
            ``ceil(batch / cap)`` pieces with the same gradient (``None``: no cap).
        lr_scaling: ``sqrt`` (default: the rule for Adam-family optimizers, HF's default AdamW included),
            ``linear`` or ``none``; the factor is relative to ``reference_batch``.
        reference_batch: the per-device batch size the configured learning rate is meant for (default
            ``initial``).
        rewarm: optimizer steps over which the LR scale moves from its value before a growth to the new one,
            linearly (``policies.growth.rewarm_scale``; 0, the default: at once). Adam's moment estimates were made
            at the old gradient noise; a short ramp avoids a sudden jump of the update size. Not with ``seesaw``
            (it reads the LR it set) or ``lr_scaling: none`` (nothing to ramp).
        apply_at: ``step`` (a change applies at the next optimizer step) or ``epoch`` (held until the next
            epoch boundary: fewer loader restarts).
        window: logged losses the loss_variability policy looks at (default 20: with ``logging_steps: 1``, enough
            values for a stable spread estimate, short enough to follow the run).
        threshold: coefficient of variation above which the loss counts as noisy (default 0.05: step-to-step
            loss of an LLM fine-tune at a small batch typically varies by 5-15 % of its value, and by less once the
            batch averages enough samples).
        switch_at: late_switch: the fraction of the run (``global_step / max_steps``) at which the batch switches
            from ``initial`` to ``maximum`` (default 0.75: late, as the paper's hard tasks prefer); with
            ``switch_patience`` the latest point of the switch.
        switch_patience: late_switch: also switch as soon as the training loss plateaus: ``switch_patience`` logged
            losses in a row whose smoothed value (median of the last ``switch_smooth``) does not improve on the best
            one by more than ``switch_min_delta`` (``lr_schedule``'s plateau rule, ``policies.lr.plateau_step``;
            judged on rank 0's losses). ``None`` (default): only ``switch_at``.
        switch_min_delta: late_switch with ``switch_patience``: the smallest drop of the smoothed loss that counts
            as an improvement (default 0.0).
        switch_smooth: late_switch with ``switch_patience``: the plateau is judged on the median of the last
            ``switch_smooth`` logged losses, once there are that many (default 5, as ``lr_schedule``'s ``smooth``: one
            noisy batch moves a median by one rank at most).
        weight_decay_scaling: ``none`` (default) or ``power_lines``: when the batch changes, scale the optimizer's
            weight decay so ``B / (lr * weight_decay)`` stays constant (``policies.growth.optimizer_scale``).
        beta2_scaling: ``none`` (default) or ``half_life``: when the batch changes, set Adam's beta2 to
            ``beta2 ** (batch / reference_batch)`` so its half-life in samples stays fixed.
        noise_decay: EMA decay of the noise-scale terms (default 0.95, about 20 steps of memory: one step's
            estimate from a single small pass is very noisy, and McCandlish et al. smooth both terms the same way).
            The noise_scale policy also waits for ``window`` measured steps before its first decision.

    Which settings each policy reads is the ``reads`` table below; a setting the configured policy does not read
    is refused (``table`` with ``policy: interval`` would be silently ignored).

    The ``noise_scale`` policy estimates B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) from gradients
    gradient accumulation already computes: the integration measures the mean-gradient norm after a step's first
    forward/backward pass and after its last (``protocol.measure_grad_noise``; no extra passes). B_simple is in
    loss tokens; divided by the mean tokens per sample it is a global batch in samples, and divided by
    ``gradient_accumulation_steps x world size`` the per-device size to grow toward. It needs at least two passes
    per step: ``gradient_accumulation_steps >= 2`` or ``micro_batch_cap`` below the batch size.
    """

    policy: str = setting(Choice(POLICIES), 'interval')
    initial: int = setting(Int(1), 1)
    factor: float = setting(Number(1, 8, low_open=True), 2.0)
    interval: int = setting(Int(1), 100)
    maximum: int = setting(Int(1), 32)
    delay: int = setting(Int(0), 0)
    table: Mapping[int, int] = setting(IntTable(1, what='step: batch_size'), default_factory=dict)
    table_unit: str = setting(Choice(('steps', 'samples')), 'steps')
    function: Any = setting(FunctionRef(), None)
    micro_batch_cap: int | None = setting(Int(1, optional=True), None)
    lr_scaling: str = setting(Choice(('sqrt', 'linear', 'none')), 'sqrt')
    reference_batch: int | None = setting(Int(1, optional=True), None)
    rewarm: int = setting(Int(0), 0)
    apply_at: str = setting(Choice(('step', 'epoch')), 'step')
    window: int = setting(Int(2), 20)
    threshold: float = setting(Number(0, float('inf'), low_open=True, high_open=True), 0.05)
    noise_decay: float = setting(Number(0, 1, high_open=True), 0.95)
    switch_at: float = setting(Number(0, 1, low_open=True, high_open=True), 0.75)
    switch_patience: int | None = setting(Int(1, optional=True), None)
    switch_min_delta: float = setting(Number(0, float('inf'), high_open=True), 0.0)
    switch_smooth: int = setting(Int(1), 5)
    weight_decay_scaling: str = setting(Choice(('none', 'power_lines')), 'none')
    beta2_scaling: str = setting(Choice(('none', 'half_life')), 'none')

    reads = (
        Reads('policy', {
            'interval': ('factor', 'interval', 'delay'),
            'table': ('table', 'table_unit'),
            'callable': ('function', ),
            'loss_variability': ('factor', 'interval', 'delay', 'window', 'threshold'),
            'noise_scale': ('factor', 'interval', 'delay', 'window', 'noise_decay'),
            'seesaw': ('factor', ),
            'late_switch': ('switch_at', 'switch_patience'),
        }),
        Reads('lr_scaling', {'sqrt': ('reference_batch', 'rewarm'), 'linear': ('reference_batch', 'rewarm'),
                             'none': ()}),
        Reads('switch_patience', {'>= 1': ('switch_min_delta', 'switch_smooth'), 'none': ()},
              classify=lambda n: 'none' if n is None else '>= 1' if n >= 1 else 'invalid'),
    )
    controls = ('batch_size', 'num_pieces', 'lr_scale', 'optimizer_scale')

    def cross_checks(self) -> None:
        if self.maximum < self.initial:
            raise ConfigError(f'maximum: must be >= initial ({self.initial}), got {self.maximum}')
        if self.policy == 'seesaw' and self.lr_scaling != 'sqrt':
            raise ConfigError(f'lr_scaling: policy seesaw cuts the LR by sqrt(factor) for every batch x factor, so it '
                              f'needs lr_scaling: sqrt, got {self.lr_scaling!r}')
        if self.policy == 'seesaw' and self.rewarm:
            raise ConfigError(f'rewarm: policy seesaw grows when the LR it set has been cut by the schedule, so it '
                              f'cannot ramp its LR scale; use rewarm: 0 with seesaw, got {self.rewarm}')
        if self.policy == 'table' and not self.table:
            raise ConfigError('table: the table policy needs at least one {step: batch_size} entry, got none')
        if self.policy == 'callable':
            if self.function is None:
                raise ConfigError('function: the callable policy needs function: "package.module:function"')
            fn = import_callable(self.function, light=True) if isinstance(self.function, str) else self.function
            if fn is None:
                object.__setattr__(self, '_notes', (
                    f'batch_growth.function: {self.function!r} imports torch (or transformers, swift, ...), so it is '
                    'imported and checked when the trainer is built, in the training process, not here', ))
                return
            self._check_call(fn)

    def _check_call(self, fn: Callable[[int, int], int]) -> None:
        try:
            checked_size(fn(0, self.initial), f'for (step=0, batch_size={self.initial})')
        except ValueError as e:
            raise ConfigError(f'function: {e}') from None
        except Exception as e:  # noqa: BLE001 - the user's function failed: a configuration error naming it
            raise ConfigError(f'function: calling {self.function!r} as function(0, {self.initial}) failed: '
                              f'{type(e).__name__}: {e}') from None

    def notes(self) -> tuple[str, ...]:
        """What validation could not check in this process (printed by ``swift-dynamic check``)."""
        return getattr(self, '_notes', ())

    def resolved_function(self) -> Callable[[int, int], int]:
        """The ``function``, imported now (torch allowed) and checked with one call (``ConfigError`` otherwise)."""
        fn = import_callable(self.function) if isinstance(self.function, str) else self.function
        self._check_call(fn)
        return fn
