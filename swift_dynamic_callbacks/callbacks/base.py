"""The small contract every pack callback follows."""

from __future__ import annotations

import functools
import logging
import traceback
from typing import Any, Callable, ClassVar, Mapping

from transformers import TrainerCallback

from .. import distributed, protocol
from ..config import ConfigError, from_mapping
from ..records import DecisionRecord
from ..state import StateError

logger = logging.getLogger('swift_dynamic_callbacks')

#: Errors that always end the run: configuration errors and integrity failures (a corrupt state file, a sample
#: that can never fit). ``integrations.trainer.SampleTooLargeError`` is checked by name (no import of the host code).
FATAL_ERRORS: tuple[type[BaseException], ...] = (ConfigError, StateError)
_FATAL_NAMES = ('SampleTooLargeError', )


def is_fatal(error: BaseException) -> bool:
    """True for errors that must stop the run whatever ``fail_fast`` says."""
    return isinstance(error, FATAL_ERRORS) or any(cls.__name__ in _FATAL_NAMES for cls in type(error).__mro__)


def _isolated(hook: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Wrap a callback hook: skip it when the pack is off or the callback failed; turn an unexpected exception
    into one ``fault`` record and disable the callback (unless ``control.dynamic_fail_fast``)."""

    @functools.wraps(hook)
    def wrapper(self, args, state, control, *rest, **kwargs):
        if getattr(control, protocol.DISABLED, False) or getattr(self, '_sdc_fault', None) is not None:
            return None
        if name == 'on_train_begin':  # two callbacks driving the same control: refused before they fight
            protocol.claim_controls(self, self.name or type(self).__name__, self.controls, state)
        try:
            return hook(self, args, state, control, *rest, **kwargs)
        except Exception as error:  # noqa: BLE001 - fault isolation: see DynamicCallback
            if is_fatal(error) or getattr(control, protocol.FAIL_FAST, False) or distributed.world_size() > 1:
                raise  # several processes: disabling on one rank would leave the others in its collectives
            self._record_fault(name, error, state, control)
            return None

    wrapper._sdc_isolated = True
    return wrapper


class DynamicCallback(TrainerCallback):
    """Base of the pack's callbacks.

    - ``name``: the name used in ms-swift's ``callbacks:`` list, in the YAML ``dynamic_callbacks:`` section and
      as ``state_key`` in checkpoints.
    - ``config_class``: a frozen, validated dataclass; ``from_mapping`` builds it from YAML. The pack's config
      classes live in ``config/`` (no torch, so the command line can validate them).
    - ``controls``: the controls (``protocol.CONTROLS``) the callback requests, whose flags hold one value per step;
      two callbacks requesting the same one are refused (``config.pack.check_controls`` for listed names, and at
      train begin for callbacks added by hand). Taken from ``config_class.controls`` unless the subclass sets it.
    - ``state_dict`` / ``load_state_dict``: what must survive resume (empty by default).
    - Talks to the trainer only through ``control`` (``protocol``); ``on_step_begin`` warns once, loudly, when
      a request was never honoured because no integration is installed. Subclasses overriding
      ``on_step_begin`` call ``super().on_step_begin(...)``.
    - Fault isolation: every ``on_*`` hook a subclass defines is wrapped (``__init_subclass__``). An unexpected
      exception inside it (a memory probe that fails, a full disk) is logged once with its traceback, queued as a
      ``fault`` decision record naming the callback and the hook, and the callback is disabled for the rest of the
      run (``fault`` holds the record); training goes on. :data:`FATAL_ERRORS` (``ConfigError``, ``StateError``)
      and ``SampleTooLargeError`` are re-raised, and so is everything when ``control.dynamic_fail_fast`` is set
      (integration setting ``fail_fast``). When the pack is off (``control.dynamic_disabled``) hooks do nothing.
      Under several processes every exception is re-raised: a callback disabled on one rank only would leave the
      other ranks waiting in its cross-rank agreement (or mismatch their collectives), a hang instead of an error.
    """

    name: ClassVar[str] = ''
    config_class: ClassVar[type] = object
    controls: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if 'controls' not in vars(cls):
            cls.controls = tuple(getattr(cls.config_class, 'controls', ()) or ())
        if cls.on_train_begin is DynamicCallback.on_train_begin:  # not defined below the base: wrap the base's
            cls.on_train_begin = DynamicCallback.on_train_begin  # (wrapped below: the controls are claimed there)
        for attr, value in list(vars(cls).items()):
            if attr.startswith('on_') and callable(value) and not getattr(value, '_sdc_isolated', False):
                setattr(cls, attr, _isolated(value, attr))

    def __init__(self, config: Any = None) -> None:
        self._sdc_fault: DecisionRecord | None = None
        self.config = config if config is not None else self.config_class()
        if not isinstance(self.config, self.config_class):
            raise TypeError(f'{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}')

    @property
    def fault(self) -> DecisionRecord | None:
        """The ``fault`` record that disabled this callback, or ``None`` while it runs."""
        return getattr(self, '_sdc_fault', None)

    def _record_fault(self, hook: str, error: BaseException, state: Any, control: Any) -> None:
        step = getattr(state, 'global_step', None)
        text = ''.join(traceback.format_exception(type(error), error, error.__traceback__))
        message = (f'{self.name}: {type(error).__name__} in {hook}: {error}; the callback is disabled for the rest '
                   'of the run, training goes on (integration setting fail_fast: true makes this fatal)')
        record = DecisionRecord(self.name or type(self).__name__, 'fault', type(error).__name__, {
            'callback': self.name or type(self).__name__,
            'hook': hook,
            'error': f'{type(error).__name__}: {error}',
            'traceback': text,
        }, message, step=step)
        self._sdc_fault = record
        logger.error('%s\n%s', message, text)
        protocol.record_decision(control, record)

    @property
    def state_key(self) -> str:
        return self.name

    @classmethod
    def config_from_mapping(cls, mapping: Mapping[str, Any] | None) -> Any:
        return from_mapping(cls.config_class, mapping, prefix=f'dynamic_callbacks.{cls.name}')

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def on_train_begin(self, args, state, control, **kwargs):
        pass

    def on_step_begin(self, args, state, control, **kwargs):
        protocol.warn_if_unhonoured(control, f'{self.name}, step {state.global_step + 1}')
