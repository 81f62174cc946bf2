"""Which pack features each training engine supports: one table, read by ``swift-dynamic check``, by
``swift-dynamic sft`` before it launches, and by the integration's engine adapter when training starts.

Engines (``integrations.engines`` has one adapter each): ``single`` (one process), ``ddp``
(``DistributedDataParallel``), ``fsdp2`` (``fully_shard``) and ``deepspeed`` (ZeRO-2 / ZeRO-3). Whether a
run is ``single`` or ``ddp`` is only known at launch (the number of processes); ``fsdp2`` and ``deepspeed`` are
named in the ms-swift settings (``fsdp:`` / ``deepspeed:``), so their refusals are raised before any model loads.

No torch here: this module is imported by the command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from . import ConfigError

ENGINES = ('single', 'ddp', 'fsdp2', 'deepspeed')

#: why FSDP version 1 is refused (in the YAML, by accelerate's plugin at start, and by the wrapper the model got)
FSDP1_REFUSED = 'FSDP1 is not supported by swift-dynamic-callbacks; use fsdp: fsdp2 (fsdp_version: 2), DeepSpeed or DDP'

#: feature -> why FSDP2 / DeepSpeed cannot run it (they hold collectives inside forward and backward). Passes cut by
#: tokens, pieces and pass caps run there: every rank runs the same number of passes a step (zero-weight passes pad a
#: short one), see ``integrations.engines``.
_SHARDED_REASONS = {
    'fsdp2': {
        'noise_scale': 'FSDP2 reduce-scatters every pass\'s gradient into the sharded one, so the gradient-noise probe '
                       'cannot read a first pass\'s gradient on its own',
        'oom_recovery': 'FSDP2 all-gathers inside forward and reduce-scatters inside backward: a rank that runs a '
                        'pass again after an out-of-memory error would leave the other ranks waiting in a collective '
                        '(an OOM ends the run with the pass and the setting to lower; the last checkpoint resumes '
                        'with a lower pass budget)',
    },
    'deepspeed': {
        'noise_scale': 'DeepSpeed ZeRO partitions and reduces gradients inside backward, so the gradient-noise probe '
                       'cannot read a pass\'s gradient',
        'oom_recovery': 'DeepSpeed ZeRO communicates inside backward (and ZeRO-3 inside forward): a rank that runs a '
                        'pass again after an out-of-memory error would leave the other ranks waiting in a collective '
                        '(an OOM ends the run with the pass and the setting to lower; the last checkpoint resumes '
                        'with a lower pass budget)',
    },
}


@dataclass(frozen=True)
class Refusal:
    """A feature the configuration asks for that the engine cannot run."""

    engine: str
    feature: str
    setting: str  # the YAML key that asks for it
    reason: str

    @property
    def message(self) -> str:
        return (f'{self.setting}: {self.feature} is not supported under {self.engine}: {self.reason}. Remove the '
                f'setting, or train without {self.engine}')


def engine_from_swift(settings: Mapping[str, Any]) -> str | None:
    """The engine the ms-swift settings (YAML keys, or ``SftArguments`` fields) name, or ``None`` when only the
    number of processes decides (``single`` / ``ddp``).

    Raises:
        ConfigError: FSDP version 1 (``fsdp_config.fsdp_version: 1``), which the pack does not support.
    """
    if settings.get('deepspeed'):
        return 'deepspeed'
    if settings.get('fsdp'):
        fsdp_config = settings.get('fsdp_config') or {}
        version = fsdp_config.get('fsdp_version', 2) if isinstance(fsdp_config, Mapping) else 2
        if str(version) == '1':
            raise ConfigError(f'fsdp_config.fsdp_version: 1: {FSDP1_REFUSED}')
        return 'fsdp2'
    return None


def requested_features(pack: Mapping[str, Any], listed: Iterable[str]) -> dict[str, str]:
    """``feature -> the setting asking for it`` for the engine-dependent features of a pack configuration.

    ``pack`` is the ``dynamic_callbacks:`` mapping (``PackConfig.to_json()``), ``listed`` the callbacks named in
    ms-swift's ``callbacks:``.
    """
    listed = set(listed)
    features: dict[str, str] = {}
    growth = pack.get('batch_growth') or {}
    if 'batch_growth' in listed:
        if growth.get('micro_batch_cap') is not None:
            features['pieces'] = 'dynamic_callbacks.batch_growth.micro_batch_cap'
        if growth.get('policy') == 'noise_scale':
            features['noise_scale'] = 'dynamic_callbacks.batch_growth.policy'
    if 'training_log' in listed and (pack.get('training_log') or {}).get('noise_scale'):
        features.setdefault('noise_scale', 'dynamic_callbacks.training_log.noise_scale')
    if 'memory_backoff' in listed:
        features['pass_limit'] = 'callbacks: memory_backoff'
    if 'length_batching' in listed and (pack.get('length_batching') or {}).get('split') == 'passes':
        features.setdefault('pass_limit', 'dynamic_callbacks.length_batching.split')
    if 'length_batching' in listed and (pack.get('length_batching') or {}).get('pass_tokens') is not None:
        features.setdefault('pass_limit', 'dynamic_callbacks.length_batching.pass_tokens')
    if (pack.get('integration') or {}).get('oom_recovery') is True:
        features['oom_recovery'] = 'dynamic_callbacks.integration.oom_recovery'
    return features


def unsupported(engine: str, feature: str) -> str | None:
    """Why ``engine`` cannot run ``feature``, or ``None`` when it can."""
    return _SHARDED_REASONS.get(engine, {}).get(feature)


def refusals(engine: str | None, pack: Mapping[str, Any], listed: Iterable[str]) -> list[Refusal]:
    if engine is None:
        return []
    found = []
    for feature, setting in requested_features(pack, listed).items():
        reason = unsupported(engine, feature)
        if reason is not None:
            found.append(Refusal(engine, feature, setting, reason))
    return found


def check_engine(engine: str | None, pack: Mapping[str, Any], listed: Iterable[str]) -> None:
    """Raise one :class:`ConfigError` listing every feature ``engine`` cannot run."""
    found = refusals(engine, pack, listed)
    if found:
        raise ConfigError('; '.join(r.message for r in found))
