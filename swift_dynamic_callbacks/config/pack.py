"""The ``dynamic_callbacks:`` section and the callback names. No torch.

This is what ``swift-dynamic check`` / ``sft`` / ``rlhf`` import (nothing here imports torch, transformers, peft or
swift), and what the training processes use to read the settings handed over in :data:`ENV_CONFIG`:

- :func:`parse_section`: the pack's own settings (each callback's config class validates its settings; unknown
  names, settings of callbacks that are not listed, two listed callbacks that drive the same control, and a replay
  file that does not exist are refused);
- :func:`load_env_config`: the settings in :data:`ENV_CONFIG` (inline JSON, or a YAML / JSON file).

The pack against the rest of the ms-swift settings is :mod:`.launch`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .. import protocol
from ..records import DECISIONS_FILE
from . import ConfigError, from_mapping, to_mapping
from .batch_growth import BatchGrowthConfig
from .batch_schedule import BatchScheduleConfig
from .checkpoint_rotation import CheckpointRotationConfig
from .early_stopping import EarlyStoppingConfig
from .integration import IntegrationConfig
from .length_batching import LengthBatchingConfig
from .lr_schedule import LRScheduleConfig
from .memory_backoff import MemoryBackoffConfig
from .training_log import TrainingLogConfig

ENV_CONFIG = 'SWIFT_DYNAMIC_CALLBACKS_CONFIG'
SECTION = 'dynamic_callbacks'
PLUGIN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'integrations',
                           'swift_plugin.py')

#: Every pack callback by its ms-swift name, with its config class (the callback classes live in ``callbacks/``
#: and import torch; ``integrations.swift.CALLBACKS`` maps the same names to them).
CALLBACK_CONFIGS: dict[str, type] = {
    'batch_growth': BatchGrowthConfig,
    'batch_schedule': BatchScheduleConfig,
    'lr_schedule': LRScheduleConfig,
    'memory_backoff': MemoryBackoffConfig,
    'early_stopping': EarlyStoppingConfig,
    'checkpoint_rotation': CheckpointRotationConfig,
    'training_log': TrainingLogConfig,
    'length_batching': LengthBatchingConfig,
}

#: ms-swift 4.6's own entries of ``swift.callbacks.callbacks_map`` (a static copy: the command line must not import
#: swift; ``tests/test_cli_yaml.py`` compares it with the installed ms-swift).
SWIFT_CALLBACKS = ('activation_cpu_offload', 'adalora', 'deepspeed_elastic', 'early_stop', 'graceful_exit', 'lisa',
                   'perf_log')

#: HF ``lr_scheduler_type`` values whose scheduler is not a ``LambdaLR`` (the pack cannot scale or reshape them).
NON_LAMBDA_SCHEDULERS = ('reduce_lr_on_plateau', 'greedy')


@dataclass(frozen=True)
class PackConfig:
    """The validated ``dynamic_callbacks:`` section: the integration's settings and each callback's raw settings.

    ``notes``: what validation could not check in this process (e.g. a ``batch_growth.function`` whose module
    imports torch), printed by the command line; not part of the configuration.
    """

    integration: IntegrationConfig = field(default_factory=IntegrationConfig)
    callbacks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default=(), compare=False)

    def callback_config(self, name: str) -> Any:
        return from_mapping(CALLBACK_CONFIGS[name], self.callbacks.get(name), prefix=f'{SECTION}.{name}')

    def to_json(self) -> dict[str, Any]:
        return {'integration': to_mapping(self.integration), **{k: dict(v) for k, v in self.callbacks.items()}}


def _names(listed: Any, where: str) -> list[str]:
    if listed is None:
        return []
    if isinstance(listed, str):
        return [listed]
    if not isinstance(listed, (list, tuple)) or not all(isinstance(n, str) for n in listed):
        raise ConfigError(f'{where}: expected a list of callback names, got {listed!r}')
    return list(listed)


def check_controls(listed: Iterable[str]) -> None:
    """Refuse two listed pack callbacks that drive the same control (``protocol.CONTROLS``), and a pack callback
    listed twice: a request flag holds one value per step boundary, so the last request would silently win.

    Derived from each config class's ``controls``. Pairs that compose are not refused: ``length_batching``
    (``batch_plan``) cuts micro-batches of at most the batch size ``batch_growth`` / ``batch_schedule`` set;
    ``memory_backoff``'s pass limit caps the passes whatever ``num_pieces`` asks; ``lr_schedule`` shapes the LR
    and ``batch_growth``'s ``lr_scale`` multiplies it.
    """
    names = [n for n in listed if n in CALLBACK_CONFIGS]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f'callbacks: {name} is listed twice; two {name} callbacks would fight over '
                              f'{", ".join(CALLBACK_CONFIGS[name].controls) or "the same work"}')
        seen.add(name)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            shared = [c for c in CALLBACK_CONFIGS[first].controls if c in CALLBACK_CONFIGS[second].controls]
            if shared:
                hint = _CONFLICT_HINTS.get(frozenset((first, second)), '')
                raise ConfigError(protocol.controls_conflict(first, second, shared, f'List only one of them{hint}'))


_CONFLICT_HINTS = {
    frozenset(('batch_growth', 'batch_schedule')):
        ' (batch_growth with policy: table gives batch sizes from a step table, with LR scaling)',
}


def parse_section(section: Mapping[str, Any] | None, listed: Iterable[str] | None = None) -> PackConfig:
    """Validate a ``dynamic_callbacks:`` mapping; with ``listed`` (ms-swift's ``callbacks:``) check both agree.

    Raises:
        ConfigError: unknown callback name, a setting a callback rejects, settings for a callback that is not
            listed in ``callbacks:`` (they would silently do nothing), two listed callbacks driving the same
            control, or an ``integration.replay`` file that does not exist.
    """
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(f'{SECTION}: expected a mapping {{callback name: settings}}, got {section!r}')
    section = dict(section)
    integration = IntegrationConfig.from_mapping(section.pop('integration', None))
    unknown = sorted(map(str, set(section) - set(CALLBACK_CONFIGS)))
    if unknown:
        raise ConfigError(f'{SECTION}: unknown callback(s) {", ".join(unknown)}; known: '
                          f'{", ".join(sorted(CALLBACK_CONFIGS))} (and "integration")')
    for name, settings in section.items():
        if settings is not None and not isinstance(settings, Mapping):
            raise ConfigError(f'{SECTION}.{name}: expected a mapping of settings, got {settings!r}')
    pack = PackConfig(integration, {k: dict(v or {}) for k, v in section.items()})
    names = _names(list(listed), 'callbacks') if listed is not None else list(section)
    if listed is not None:
        not_listed = sorted(set(section) - set(names))
        if not_listed:
            raise ConfigError(f'{SECTION}.{not_listed[0]}: configured but not listed in callbacks: {names}; add it to '
                              'callbacks: or remove its settings')
    notes: list[str] = []
    for name in names:
        if name in CALLBACK_CONFIGS:
            config = pack.callback_config(name)  # validates, raising ConfigError naming the key
            notes.extend(getattr(config, 'renamed_notes', lambda: ())())
            notes.extend(getattr(config, 'notes', lambda: ())())
    check_controls(names)
    replay = integration.replay
    if replay is not None and not os.path.exists(replay):
        raise ConfigError(f'{SECTION}.integration.replay: {replay!r} does not exist (relative paths are read from '
                          f'the current directory, {os.getcwd()}); give a previous run\'s {DECISIONS_FILE} or '
                          'its output directory')
    if replay is not None and os.path.isdir(replay) and not os.path.isfile(os.path.join(replay, DECISIONS_FILE)):
        raise ConfigError(f'{SECTION}.integration.replay: the folder {replay!r} holds no {DECISIONS_FILE}; '
                          'give a previous run\'s decision log or the output directory that holds it')
    return replace(pack, notes=tuple(notes))


# ---- the environment variable -------------------------------------------------------------------------------


def load_env_config(environ: Mapping[str, str] | None = None) -> PackConfig | None:
    """The pack settings handed over in :data:`ENV_CONFIG`: inline JSON (``{...}``), or the path of a YAML / JSON
    file holding the ``dynamic_callbacks:`` section (or just its content). ``None`` when the variable is unset or
    empty.

    Raises:
        ConfigError: naming :data:`ENV_CONFIG` in every case: bad JSON or YAML, a file that does not exist or is
            empty, content that is not a mapping, or settings :func:`parse_section` rejects.
    """
    raw = (os.environ if environ is None else environ).get(ENV_CONFIG)
    if raw is None or raw == '':
        return None
    text = raw.strip()
    if text[:1] in '{[' and text:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f'{ENV_CONFIG}: not valid inline JSON ({e}); give {{"callback": {{settings}}}} or the '
                              'path of a YAML / JSON file') from None
        where = 'inline JSON'
    else:
        if not os.path.isfile(raw):
            raise ConfigError(f'{ENV_CONFIG}: {raw!r} is neither inline JSON ({{...}}) nor an existing file')
        import yaml
        try:
            with open(raw, encoding='utf-8') as f:
                data = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f'{ENV_CONFIG}: cannot read {raw!r} as YAML / JSON: {e}') from None
        if data is None:
            raise ConfigError(f'{ENV_CONFIG}: {raw!r} is empty; give the {SECTION}: section (a mapping)')
        where = raw
        if isinstance(data, Mapping) and SECTION in data:
            data = data[SECTION]
            if data is None:
                data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f'{ENV_CONFIG} ({where}): expected a mapping {{callback name: settings}}, got '
                          f'{data!r} ({type(data).__name__})')
    try:
        return parse_section(data)
    except ConfigError as e:
        raise ConfigError(f'{ENV_CONFIG} ({where}): {e}') from None
