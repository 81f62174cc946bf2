"""The small contract every pack callback follows."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from transformers import TrainerCallback

from .. import protocol
from ..config import from_mapping


class DynamicCallback(TrainerCallback):
    """Base of the pack's callbacks.

    - ``name``: the name used in ms-swift's ``callbacks:`` list, in the YAML ``dynamic_callbacks:`` section and
      as ``state_key`` in checkpoints.
    - ``config_class``: a frozen, validated dataclass; ``from_mapping`` builds it from YAML.
    - ``state_dict`` / ``load_state_dict``: what must survive resume (empty by default).
    - Talks to the trainer only through ``control`` (``protocol``); ``on_step_begin`` warns once, loudly, when
      a request was never honoured because no integration is installed. Subclasses overriding
      ``on_step_begin`` call ``super().on_step_begin(...)``.
    """

    name: ClassVar[str] = ''
    config_class: ClassVar[type] = object

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.config_class()
        if not isinstance(self.config, self.config_class):
            raise TypeError(f'{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}')

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

    def on_step_begin(self, args, state, control, **kwargs):
        protocol.warn_if_unhonoured(control, f'{self.name}, step {state.global_step + 1}')
