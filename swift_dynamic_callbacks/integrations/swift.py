"""ms-swift registration: the pack's callbacks by name, their YAML settings, the plugin file.

ms-swift looks callbacks up by name in ``swift.callbacks.callbacks_map`` (``name -> factory(args, trainer)``)
and passes no parameters, so the settings travel separately:

- ``swift-dynamic sft my.yaml`` (``cli``) takes the ``dynamic_callbacks:`` section out of the YAML, validates
  it, and hands it to the training process in the environment variable :data:`ENV_CONFIG` (inline JSON);
- ``ENV_CONFIG`` may also name a YAML/JSON file, for plain ``swift sft`` runs;
- in Python, :func:`register` takes the settings directly.

Each factory installs the integration on the trainer (once) and builds its callback from its settings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..callbacks import (BatchGrowthCallback, BatchScheduleCallback, CheckpointRotationCallback, DynamicCallback,
                         EarlyStoppingCallback, LengthBatchingCallback, LRScheduleCallback, MemoryBackoffCallback,
                         TrainingLogCallback)
from ..config import ConfigError
from transformers import TrainerCallback

from .trainer import IntegrationConfig, PackOffCallback, install, pack_disabled

ENV_CONFIG = 'SWIFT_DYNAMIC_CALLBACKS_CONFIG'
SECTION = 'dynamic_callbacks'
PLUGIN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'swift_plugin.py')

#: Every pack callback by its ms-swift name.
CALLBACKS: dict[str, type[DynamicCallback]] = {
    cls.name: cls
    for cls in (BatchGrowthCallback, BatchScheduleCallback, LRScheduleCallback, MemoryBackoffCallback,
                EarlyStoppingCallback, CheckpointRotationCallback, TrainingLogCallback, LengthBatchingCallback)
}


@dataclass(frozen=True)
class PackConfig:
    """The validated ``dynamic_callbacks:`` section: the integration's settings and each callback's raw settings."""

    integration: IntegrationConfig = field(default_factory=IntegrationConfig)
    callbacks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def callback_config(self, name: str) -> Any:
        return CALLBACKS[name].config_from_mapping(self.callbacks.get(name))

    def to_json(self) -> dict[str, Any]:
        from ..config import to_mapping
        return {'integration': to_mapping(self.integration), **{k: dict(v) for k, v in self.callbacks.items()}}


def parse_section(section: Mapping[str, Any] | None, listed: Iterable[str] | None = None) -> PackConfig:
    """Validate a ``dynamic_callbacks:`` mapping; with ``listed`` (ms-swift's ``callbacks:``) check both agree.

    Raises:
        ConfigError: unknown callback name, a setting a callback rejects, or settings for a callback that is
            not listed in ``callbacks:`` (they would silently do nothing).
    """
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(f'{SECTION}: expected a mapping {{callback name: settings}}, got {section!r}')
    section = dict(section)
    integration = IntegrationConfig.from_mapping(section.pop('integration', None))
    unknown = sorted(set(section) - set(CALLBACKS))
    if unknown:
        raise ConfigError(f'{SECTION}: unknown callback(s) {", ".join(unknown)}; known: '
                          f'{", ".join(sorted(CALLBACKS))} (and "integration")')
    for name, settings in section.items():
        if settings is not None and not isinstance(settings, Mapping):
            raise ConfigError(f'{SECTION}.{name}: expected a mapping of settings, got {settings!r}')
    pack = PackConfig(integration, {k: dict(v or {}) for k, v in section.items()})
    names = list(listed) if listed is not None else list(section)
    if listed is not None:
        not_listed = sorted(set(section) - set(names))
        if not_listed:
            raise ConfigError(f'{SECTION}.{not_listed[0]}: configured but not listed in callbacks: {names}; add it to '
                              'callbacks: or remove its settings')
    for name in names:
        if name in CALLBACKS:
            pack.callback_config(name)  # validates, raising ConfigError naming the key
    return pack


def load_env_config() -> PackConfig | None:
    """The pack settings handed over in :data:`ENV_CONFIG` (inline JSON, or a path to a YAML/JSON file)."""
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        return None
    if raw.lstrip().startswith('{'):
        data = json.loads(raw)
    else:
        if not os.path.exists(raw):
            raise ConfigError(f'{ENV_CONFIG}: {raw!r} is neither inline JSON nor an existing file')
        import yaml
        with open(raw, encoding='utf-8') as f:
            data = yaml.safe_load(f) or {}
        data = data.get(SECTION, data)
    return parse_section(data)


_configured: PackConfig | None = None


def current_config() -> PackConfig:
    return _configured or load_env_config() or PackConfig()


def _factory(name: str):
    cls = CALLBACKS[name]

    def make(args: Any, trainer: Any) -> DynamicCallback:
        pack = current_config()
        listed = list(getattr(args, 'callbacks', None) or [name])
        parse_section({'integration': {}, **pack.callbacks}, listed)  # settings for unlisted callbacks -> error
        config = pack.callback_config(name)  # validated even when the pack is off
        why = pack_disabled(pack.integration)
        if why is not None:  # baseline run: no integration, no pack callback; one stand-in writes the "off" record
            if getattr(trainer, '_sdc_pack_off', False):
                return TrainerCallback()
            trainer._sdc_pack_off = True
            return PackOffCallback(why, [n for n in listed if n in CALLBACKS])
        install(trainer, pack.integration, pack.to_json())
        return cls(config)

    make.__name__ = f'make_{name}'
    return make


def register(settings: Mapping[str, Any] | None = None, **by_name: Any) -> PackConfig:
    """Register the pack's callbacks in ms-swift's ``callbacks_map`` with their settings (validated now).

    ``register({'batch_schedule': {'schedule': {0: 2, 10: 4}}})`` or ``register(batch_schedule={...})``; a config
    dataclass instance is accepted in place of a mapping. Without arguments the settings come from
    :data:`ENV_CONFIG` (how ``swift-dynamic sft`` hands them over). Returns the validated settings.
    """
    global _configured
    from swift.callbacks import callbacks_map

    merged = dict(settings or {})
    merged.update(by_name)
    if merged:
        from ..config import to_mapping
        raw = {k: (v if isinstance(v, Mapping) or v is None else to_mapping(v)) for k, v in merged.items()}
        _configured = parse_section(raw)
    elif _configured is None:
        _configured = load_env_config()  # validated now: the plugin is imported while ms-swift parses arguments
    for name in CALLBACKS:
        callbacks_map[name] = _factory(name)
    return current_config()
