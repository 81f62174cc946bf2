"""ms-swift registration: the pack's callbacks by name, their YAML settings, the plugin file.

ms-swift looks callbacks up by name in ``swift.callbacks.callbacks_map`` (``name -> factory(args, trainer)``)
and passes no parameters, so the settings travel separately:

- ``swift-dynamic sft my.yaml`` (``cli``) takes the ``dynamic_callbacks:`` section out of the YAML, validates
  it, and hands it to the training process in the environment variable :data:`ENV_CONFIG` (inline JSON);
- ``ENV_CONFIG`` may also name a YAML/JSON file, for plain ``swift sft`` runs;
- in Python, :func:`register` takes the settings directly.

Each factory installs the integration on the trainer (once) and builds its callback from its settings. With no pack
callback listed, the integration is installed all the same whenever the pack is on (registered, not disabled): OOM
recovery and the integration's pass settings work alone (:func:`_install_when_none_listed`).
"""

from __future__ import annotations

import enum
import os
from typing import Any, Mapping

from transformers import TrainerCallback

from ..callbacks import (BatchGrowthCallback, BatchScheduleCallback, CheckpointRotationCallback, DynamicCallback,
                         EarlyStoppingCallback, LengthBatchingCallback, LRScheduleCallback, MemoryBackoffCallback,
                         TrainingLogCallback)
from ..config import ConfigError, to_mapping  # noqa: F401 - ConfigError re-exported
from ..config.integration import IntegrationConfig  # noqa: F401 - re-exported
from ..config.launch import check_settings
from ..config.pack import (CALLBACK_CONFIGS, ENV_CONFIG, PLUGIN_FILE, SECTION, PackConfig,  # noqa: F401
                           load_env_config, parse_section)
from .hooks import PackOffCallback, install, pack_disabled

#: Every pack callback by its ms-swift name (the same names as ``config.pack.CALLBACK_CONFIGS``, which the
#: torch-free command line uses).
CALLBACKS: dict[str, type[DynamicCallback]] = {
    cls.name: cls
    for cls in (BatchGrowthCallback, BatchScheduleCallback, LRScheduleCallback, MemoryBackoffCallback,
                EarlyStoppingCallback, CheckpointRotationCallback, TrainingLogCallback, LengthBatchingCallback)
}
assert set(CALLBACKS) == set(CALLBACK_CONFIGS) and all(
    CALLBACKS[n].config_class is CALLBACK_CONFIGS[n] for n in CALLBACKS), 'config.pack.CALLBACK_CONFIGS is out of date'


_configured: PackConfig | None = None
_active = False  # registered (the plugin imported, or register() called) and not unregistered since


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
    global _configured, _active
    from swift.callbacks import callbacks_map

    merged = dict(settings or {})
    merged.update(by_name)
    if merged:
        raw = {k: (v if isinstance(v, Mapping) or v is None else to_mapping(v, changed_only=True))
               for k, v in merged.items()}
        _configured = parse_section(raw)
    elif _configured is None:
        _configured = load_env_config()  # validated now: the plugin is imported while ms-swift parses arguments
    for name in CALLBACKS:
        callbacks_map[name] = _factory(name)
    _check_before_the_model_loads()
    _install_when_none_listed()
    _active = True
    return current_config()


def check_pipeline(args: Any) -> None:
    """The pack's launch checks on ms-swift's parsed arguments, before the model loads (the plugin and Python routes;
    the command line runs them on the YAML first): settings of pack callbacks that are not listed (nothing would read
    them), then :func:`..config.launch.check_settings` on :func:`parsed_settings` (what ``rlhf_type`` allows, what the
    engine named by ``deepspeed`` / ``fsdp`` cannot run, every launch rule). Nothing when the pack is off or not
    registered; with no pack callback listed, for the integration alone."""
    listed = [n for n in (getattr(args, 'callbacks', None) or []) if n in CALLBACKS]
    pack = current_config()
    if not (_active or listed) or pack_disabled(pack.integration) is not None:
        return
    parse_section({'integration': {}, **pack.callbacks}, listed)  # settings for unlisted callbacks -> error
    check_settings(pack, parsed_settings(args), listed, world_size=_launch_world_size())


def parsed_settings(args: Any) -> dict[str, Any]:
    """ms-swift's parsed arguments as the launch rules read a YAML's settings: each attribute that is set (``None``
    left out: an absent key is ms-swift's default to the rules), an enum (HF's ``IntervalStrategy``,
    ``SchedulerType``, ``OptimizerNames``) as its value. ``deepspeed`` stays the dict ms-swift parsed it into and
    ``fsdp`` its options beside ``fsdp_config`` (``config.engines.engine_from_swift`` reads both forms)."""
    settings = {}
    for name, value in vars(args).items():
        if value is None or name.startswith('_'):
            continue
        settings[name] = value.value if isinstance(value, enum.Enum) else value
    return settings


def _launch_world_size() -> int:
    """The run's processes as seen before the model loads: torchrun's ``WORLD_SIZE`` in a training process."""
    try:
        return max(1, int(os.environ.get('WORLD_SIZE', '1')))
    except ValueError:
        return 1


def _install_when_none_listed() -> None:
    """Make ms-swift's trainers install the integration when the pack is on and no pack callback is listed (the
    factories install it otherwise): patched once into ``SwiftMixin._get_callbacks``, where ms-swift builds the listed
    callbacks (the trainer under construction, as the factories see it). When the pack is off, one stand-in writes
    the ``pack`` / ``disabled`` record instead."""
    from swift.trainers.mixin import SwiftMixin
    original = SwiftMixin.__dict__.get('_get_callbacks')
    if original is None or getattr(original, '_sdc_patched', False):
        return

    def _get_callbacks(self, args, _original=original):
        callbacks = _original(self, args)
        if not _active or any(n in CALLBACKS for n in (getattr(args, 'callbacks', None) or [])):
            return callbacks
        pack = current_config()
        why = pack_disabled(pack.integration)
        if why is not None:
            return callbacks + [PackOffCallback(why)]
        install(self, pack.integration, pack.to_json())
        return callbacks

    _get_callbacks._sdc_patched = True
    SwiftMixin._get_callbacks = _get_callbacks


def _check_before_the_model_loads() -> None:
    """Run :func:`check_pipeline` in ms-swift's training pipelines right after their arguments are parsed and before
    the model loads (``_prepare_model_tokenizer`` of ``SwiftSft`` and of the classes that override it), once."""
    from swift.pipelines.train import rlhf, sft
    for cls in (sft.SwiftSft, rlhf.SwiftRLHF):
        original = cls.__dict__.get('_prepare_model_tokenizer')
        if original is None or getattr(original, '_sdc_checked', False):
            continue

        def checked(self, *args, _original=original, **kwargs):
            check_pipeline(self.args)
            return _original(self, *args, **kwargs)

        checked._sdc_checked = True
        setattr(cls, '_prepare_model_tokenizer', checked)


def unregister() -> None:
    """Forget the settings :func:`register` took (the next run reads :data:`ENV_CONFIG` again, or the defaults); the
    factories stay in ``callbacks_map``. :func:`swift_dynamic_callbacks.run.registered` calls it after each run."""
    global _configured, _active
    _configured = None
    _active = False
