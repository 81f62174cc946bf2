"""The pack against the rest of the ms-swift settings, before anything loads. No torch.

What ``swift-dynamic check`` / ``sft`` / ``rlhf`` run on a YAML file (with the flags given after it):
:func:`check_run` refuses unknown names in ``callbacks:``, the engine's refusals, streaming and packing with split
micro-batches, ``swift rlhf`` types and split passes of pairs, settings the integration refuses at start-up, monitors
of evaluation metrics in a run that never evaluates, ... — everything that would otherwise only fail after the model
has loaded. The flags after the file are read as ``swift sft`` reads them (:func:`read_flags`). Each check is a small
named rule (:data:`LAUNCH_RULES`); the ones the training process checks again at start are written once in
:mod:`.rules` and called from both places. The ``swift sft`` and Python routes run the same checks
(:func:`check_settings`) on ms-swift's parsed arguments, before the model loads.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from ..state import STATE_FILE
from . import ConfigError
from .engines import check_engine, engine_from_swift
from .integration import IntegrationConfig
from .models import ModelFacts, model_facts
from .rules import RLHF_RUN_LEVEL, RunFacts, check_facts, noise_scale_passes, pass_splitters, rlhf_refusal
from .pack import (CALLBACK_CONFIGS, NON_LAMBDA_SCHEDULERS, PLUGIN_FILE, SECTION, SWIFT_CALLBACKS, PackConfig,
                   _names, check_controls)



def _scalar(text: str) -> Any:
    low = text.strip().lower()
    if low in ('true', 'false'):
        return low == 'true'
    if low in ('none', 'null'):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in '{[':
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def _flag_name(token: str) -> str | None:
    """The setting a command-line token names when it is a flag (``--key``, ``--key=value``; ``-`` read as ``_``,
    as ms-swift's HfArgumentParser takes ``--dataloader-drop-last`` too), else ``None`` (a value)."""
    if not token.startswith('--') or len(token) <= 2:
        return None
    return token[2:].partition('=')[0].replace('-', '_')


def read_flags(argv: Sequence[str]) -> dict[str, Any]:
    """ms-swift flags given after the YAML file (``--key value [value ...]``, ``--key=value``, a bare ``--flag``
    is ``true``) as settings; they override the file's keys, as in ``swift sft``."""
    out: dict[str, Any] = {}
    key: str | None = None
    values: list[str] = []

    def close() -> None:
        if key is not None:
            out[key] = True if not values else (_scalar(values[0]) if len(values) == 1 else list(values))

    for token in argv:
        name = _flag_name(token)
        if name is not None:
            close()
            key = name
            values = [token.partition('=')[2]] if '=' in token else []
        elif key is not None:
            values.append(token)
    close()
    return out


def drop_flag(argv: Sequence[str], name: str) -> list[str]:
    """``argv`` without the flag ``--name`` (either spelling, ``-`` or ``_``) and its values."""
    out: list[str] = []
    dropping = False
    for token in argv:
        flag = _flag_name(token)
        if flag is not None:
            dropping = flag == name
        if not dropping:
            out.append(token)
    return out


def merged_settings(config: Mapping[str, Any], argv: Sequence[str]) -> dict[str, Any]:
    """The YAML's ms-swift settings with the flags after the file applied."""
    return {**config, **read_flags(argv)}


def listed_callbacks(settings: Mapping[str, Any]) -> list[str]:
    """The names in ms-swift's ``callbacks:`` (a list, or one name)."""
    return [str(n) for n in _names(settings.get('callbacks') or [], 'callbacks')]


def _flag(settings: Mapping[str, Any], key: str) -> bool:
    value = settings.get(key)
    if isinstance(value, str):
        return value.strip().lower() in ('true', '1', 'yes')
    return bool(value) and value is not False


def _number(settings: Mapping[str, Any], key: str, default: float | None = None) -> float | None:
    value = settings.get(key, default)
    if isinstance(value, str):
        value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return value


def evaluates(settings: Mapping[str, Any]) -> bool:
    """Whether an ms-swift run with these settings evaluates (ms-swift sets ``eval_strategy: no`` without
    evaluation data: no ``val_dataset`` / ``eval_dataset`` and ``split_dataset_ratio`` 0, its default)."""
    strategy = settings.get('eval_strategy')
    if strategy is None:
        strategy = settings.get('save_strategy')
    if isinstance(strategy, str) and strategy.strip().lower() == 'no':
        return False
    if settings.get('val_dataset') or settings.get('eval_dataset'):
        return True
    return bool(settings.get('dataset')) and (_number(settings, 'split_dataset_ratio', 0.0) or 0.0) > 0


def _plugins(settings: Mapping[str, Any]) -> list[str]:
    plugins = settings.get('external_plugins') or []
    plugins = [plugins] if isinstance(plugins, str) else [str(p) for p in plugins]
    ours = os.path.realpath(PLUGIN_FILE)
    return [p for p in plugins if os.path.realpath(p) != ours]


def _world_size() -> int:
    try:
        return max(int(os.environ.get('NPROC_PER_NODE', '1')), 1) * max(int(os.environ.get('NNODES', '1')), 1)
    except ValueError:
        return 1


def _transformers_major() -> int:
    """The installed transformers' major version, read from its metadata (no import); 5 when unknown."""
    try:
        return int(importlib.metadata.version('transformers').split('.')[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 5


@dataclass(frozen=True)
class LaunchRun:
    """What a launch rule reads: the pack, the ms-swift settings, the pack callbacks listed (their settings) and the
    run's number of processes."""

    pack: PackConfig
    settings: Mapping[str, Any]
    configs: Mapping[str, Any]
    world_size: int = 1

    def number(self, key: str, default: float | None = None) -> float | None:
        return _number(self.settings, key, default)

    def flag(self, key: str) -> bool:
        return _flag(self.settings, key)

    @functools.cached_property
    def model(self) -> ModelFacts:
        """What the settings say of the model (:func:`.models.model_facts`: its ``config.json`` when it is a local
        folder), read once."""
        return model_facts(self.settings)

    def facts(self) -> RunFacts:
        """The facts the run rules read (:mod:`.rules`), from the settings."""
        steps = self.number('max_steps', -1)
        model = self.model
        return RunFacts(sequence_parallel_size=self.number('sequence_parallel_size', 1) or 1,
                        dataloader_drop_last=self.flag('dataloader_drop_last'),
                        auto_find_batch_size=self.flag('auto_find_batch_size'), streaming=self.flag('streaming'),
                        max_steps=-1 if steps is None else steps,
                        max_steps_unit=self.pack.integration.max_steps_unit,
                        splitters=tuple(pass_splitters(self.configs)), task_type=self.settings.get('task_type'),
                        loss_type=self.settings.get('loss_type'),
                        label_smoothing_factor=self.number('label_smoothing_factor', 0) or 0.0,
                        router_aux_loss_coef=self.number('router_aux_loss_coef', 0) or 0.0, world_size=self.world_size,
                        average_tokens_across_devices=(self.flag('average_tokens_across_devices')
                                                       if 'average_tokens_across_devices' in self.settings else True),
                        include_num_input_tokens_seen=str(self.settings.get('include_num_input_tokens_seen', 'no'))
                        .strip().lower() not in ('no', 'false', '0', 'none', 'n', 'f'),
                        tokens_counted_per_slot=_transformers_major() >= 5,
                        oom_recovery=self.pack.integration.oom_recovery,
                        packed=self.flag('packing') or self.flag('padding_free'),
                        moe=model.moe is not False, layout=model.layout, model_setting=model.setting)


def engine_pack(pack: PackConfig, settings: Mapping[str, Any]) -> PackConfig:
    """The pack as the engine table (``config.engines``) and the step runner's rules read it: under GRPO / GKD with
    ``grpo_pass_tokens``, OOM recovery is the GRPO passes' own (one process, checked by ``rules.rlhf_refusal``), so
    they see ``oom_recovery: auto``."""
    if (str(settings.get('rlhf_type') or '').lower() in RLHF_RUN_LEVEL
            and pack.integration.grpo_pass_tokens is not None):
        return replace(pack, integration=replace(pack.integration, oom_recovery='auto'))
    return pack


def check_engine_settings(pack: PackConfig, settings: Mapping[str, Any], listed: Sequence[str]) -> None:
    """Refuse what the engine the ms-swift settings name (``deepspeed:`` / ``fsdp:``) cannot run, before any model
    loads: the command line on the YAML (:func:`check_run`), the ``swift sft`` / Python routes on the parsed
    arguments (``integrations.swift.check_pipeline``).

    Raises:
        ConfigError: every refused feature with its setting and the engine (``config.engines.check_engine``).
    """
    check_engine(engine_from_swift(settings), engine_pack(pack, settings).to_json(), listed)


def check_run(pack: PackConfig, settings: Mapping[str, Any], listed: Sequence[str] | None = None) -> list[str]:
    """Check the pack against the rest of the ms-swift settings (the YAML with the flags after it applied), before
    any model loads: the names in ``callbacks:``, then :func:`check_settings` (``NPROC_PER_NODE`` x ``NNODES``
    processes). Returns notes (warnings) for what cannot be decided here.

    Raises:
        ConfigError: naming the setting, the value and what is allowed (see the module docstring for the list).
    """
    listed = listed_callbacks(settings) if listed is None else list(listed)
    notes = list(pack.notes) + _unknown_callbacks(listed, settings)
    check_settings(pack, settings, listed, world_size=_world_size())
    return notes


def check_settings(pack: PackConfig, settings: Mapping[str, Any], listed: Sequence[str], *, world_size: int) -> None:
    """Every launch check of the pack against ms-swift's settings on ``world_size`` processes: the controls, what
    ``rlhf_type`` allows, the engine, then :data:`LAUNCH_RULES` in order. The command line runs it on the YAML
    (:func:`check_run`); the ``swift sft`` / Python routes on ms-swift's parsed arguments, before the model loads
    (``integrations.swift.check_pipeline``). An absent key (or ``None``) is ms-swift's default.

    Raises:
        ConfigError: naming the setting, the value and what is allowed (see the module docstring for the list).
    """
    pack_listed = [n for n in listed if n in CALLBACK_CONFIGS]
    check_controls(pack_listed)
    configs = {n: pack.callback_config(n) for n in pack_listed}
    if str(settings.get('rlhf_type') or '').lower() in RLHF_RUN_LEVEL:
        _check_rlhf(pack, settings, configs, world_size)  # GRPO / GKD: what the rollout trainer allows first
    check_engine_settings(pack, settings, listed)
    pack = engine_pack(pack, settings)
    # The integration runs whenever the pack is on, a pack callback listed or not (OOM recovery and the pass settings
    # work alone), so every rule applies; a rule about a callback finds none when it is not listed.
    run = LaunchRun(pack, settings, configs, world_size)  # engine_pack changes the integration section only
    for rule in LAUNCH_RULES:
        rule(run)


def check_callback_names(settings: Mapping[str, Any]) -> list[str]:
    """The names in ``callbacks:`` checked first (a misspelled pack callback is named as such, with the closest name,
    before its settings block would be reported as configured but not listed): :func:`_unknown_callbacks`."""
    return _unknown_callbacks(listed_callbacks(settings), settings)


def _unknown_callbacks(listed: Sequence[str], settings: Mapping[str, Any]) -> list[str]:
    """Names in ``callbacks:`` that are neither the pack's nor ms-swift's: refused, or a note when another external
    plugin may register them."""
    unknown = [n for n in listed if n not in CALLBACK_CONFIGS and n not in SWIFT_CALLBACKS]
    if not unknown:
        return []
    known = f'pack callbacks: {", ".join(sorted(CALLBACK_CONFIGS))}; ms-swift callbacks: {", ".join(SWIFT_CALLBACKS)}'
    others = _plugins(settings)
    if not others:
        close = difflib.get_close_matches(unknown[0], list(CALLBACK_CONFIGS) + list(SWIFT_CALLBACKS), n=1,
                                          cutoff=0.7)
        hint = f'; did you mean {close[0]}?' if close else ''
        raise ConfigError(f'callbacks: {", ".join(map(repr, unknown))} is not a known callback name{hint} ({known}); '
                          'ms-swift would fail with a KeyError when it builds the trainer')
    return [f'callbacks: {", ".join(map(repr, unknown))} is neither a pack nor an ms-swift callback; it must be '
            f'registered by external_plugins {", ".join(others)} (not checked here: ms-swift fails with a KeyError '
            'when it builds the trainer if none does)']


def _run_facts(run: LaunchRun) -> None:
    """The rules the training process checks again at start (:mod:`.rules`)."""
    check_facts(run.facts())


def _split_passes_and_backoff(run: LaunchRun) -> None:
    length = run.configs.get('length_batching')
    if length is not None and length.splits_passes and 'memory_backoff' in run.configs:
        raise ConfigError('dynamic_callbacks.length_batching.split: passes sets the pass limit, which memory_backoff '
                          'also sets (the last request would silently win); use split: micro_batches with '
                          'memory_backoff, or leave memory_backoff out')


def _stream_window(run: LaunchRun) -> None:
    if not run.flag('streaming') and run.pack.integration.stream_window != IntegrationConfig().stream_window:
        raise ConfigError(f'{SECTION}.integration.stream_window: only read with streaming: true (it bounds the length '
                          f'buckets of a stream), got {run.pack.integration.stream_window} in a run without streaming; '
                          'remove it, or set streaming: true')


def _packed_attention(run: LaunchRun) -> None:
    length = run.configs.get('length_batching')
    mode = run.pack.integration.packed_attention
    if mode != IntegrationConfig().packed_attention and not (length is not None and length.padding_free):
        raise ConfigError(f'{SECTION}.integration.packed_attention: only read with length_batching.padding_free: '
                          f'true (it chooses the attention packed rows run with), got {mode!r} in a run without '
                          'padding-free micro-batches; remove it, or set length_batching.padding_free: true')


def _samples_unit(run: LaunchRun) -> None:
    if run.pack.integration.max_steps_unit == 'samples' and (run.number('max_steps', -1) or -1) <= 0:
        raise ConfigError(f'{SECTION}.integration.max_steps_unit: samples counts max_steps in samples, but max_steps '
                          'is not set (the run goes by num_train_epochs, which counts epochs whatever the batch size); '
                          'set max_steps, or remove max_steps_unit')


def _packing(run: LaunchRun) -> None:
    packed = [k for k in ('packing', 'padding_free') if run.flag(k)]
    splitters = pass_splitters(run.configs)
    if packed and splitters:
        raise ConfigError(f'{packed[0]}: true cannot be combined with {splitters[0]}: a packed micro-batch is one '
                          '[1, N] row and cannot be split into smaller forward/backward passes; remove '
                          f'{splitters[0]} or set {packed[0]}: false')


def _rotation_limit(run: LaunchRun) -> None:
    limit = run.number('save_total_limit')
    if 'checkpoint_rotation' in run.configs and limit is not None and limit > 0:
        rotation = run.configs['checkpoint_rotation']
        raise ConfigError(f'save_total_limit: checkpoint_rotation deletes checkpoints itself, so HF\'s '
                          f'save_total_limit must be unset, got {limit:g}; use {SECTION}.checkpoint_rotation.keep_last '
                          f'(now {rotation.keep_last}) and keep_best (now {rotation.keep_best}) instead')


def _eval_metrics(run: LaunchRun) -> None:
    if evaluates(run.settings):
        return
    for name, key, metric in _eval_monitors(run.configs):
        raise ConfigError(f'{SECTION}.{name}.{key}: {metric!r} is an evaluation metric but this run never '
                          'evaluates (no val_dataset, split_dataset_ratio 0, or eval_strategy no); give it '
                          'evaluation data (split_dataset_ratio or val_dataset, eval_steps) or watch a training '
                          'value such as loss')


def _lambda_scheduler(run: LaunchRun) -> None:
    scheduler = str(run.settings.get('lr_scheduler_type') or '').strip().lower()
    if scheduler not in NON_LAMBDA_SCHEDULERS:
        return
    users = ['callbacks: lr_schedule'] if 'lr_schedule' in run.configs else []
    growth = run.configs.get('batch_growth')
    if growth is not None and growth.lr_scaling != 'none':
        users.append(f'{SECTION}.batch_growth.lr_scaling: {growth.lr_scaling}')
    if users:
        raise ConfigError(f'lr_scheduler_type: {scheduler} is not a LambdaLR schedule, so the pack cannot reshape '
                          f'or scale it ({users[0]}); use one of HF\'s LambdaLR schedules (linear, cosine, '
                          'constant, constant_with_warmup, warmup_stable_decay, ...) or remove that setting')


#: ms-swift's default global batch: ``gradient_accumulation_steps`` defaults to ``ceil(16 / batch / processes)``
SWIFT_GLOBAL_BATCH = 16


def _noise_asks(run: LaunchRun) -> list[tuple[str, int | None, int]]:
    """The settings that ask for the gradient-noise probe: ``(name, micro_batch_cap, maximum)`` each."""
    growth, log = run.configs.get('batch_growth'), run.configs.get('training_log')
    asks = []
    if growth is not None and growth.policy == 'noise_scale':
        asks.append((f'{SECTION}.batch_growth.policy: noise_scale', growth.micro_batch_cap, growth.maximum))
    if log is not None and log.noise_scale:
        asks.append((f'{SECTION}.training_log.noise_scale', None, 1))
    return asks


def _noise_scale(run: LaunchRun) -> None:
    """The gradient-noise probe needs two passes a step (:func:`_noise_asks` names who asks for it)."""
    accumulation = run.number('gradient_accumulation_steps')
    if accumulation is None:
        batch = run.number('per_device_train_batch_size', 1) or 1
        accumulation = max(1, math.ceil(SWIFT_GLOBAL_BATCH / batch / run.world_size))  # ms-swift's default
    batching = run.configs.get('length_batching')
    for setting, cap, maximum in _noise_asks(run):
        message = noise_scale_passes(setting, accumulation, cap, maximum,
                                     pass_tokens=batching is not None and batching.pass_tokens is not None)
        if message is not None:
            raise ConfigError(message)


def _optimizer_scaling(run: LaunchRun) -> None:
    growth = run.configs.get('batch_growth')
    if growth is not None:
        _check_optimizer_scaling(growth, run.settings)


def _memory_probe(run: LaunchRun) -> None:
    memory = run.configs.get('memory_backoff')
    if memory is not None and memory.probe == 'auto' and memory.cpu_budget_gib is None and run.flag('use_cpu'):
        raise ConfigError(f'{SECTION}.memory_backoff.cpu_budget_gib: use_cpu: true trains on the CPU, where memory '
                          'pressure is the process RSS against a budget; set cpu_budget_gib (e.g. 16) or remove '
                          'memory_backoff (OOM recovery is the integration\'s and stays on)')


def _group_by_length(run: LaunchRun) -> None:
    if run.flag('group_by_length') and run.world_size > 1:
        raise group_by_length_error(f'{run.world_size} processes')


def _ignore_data_skip(run: LaunchRun) -> None:
    checkpoint = run.settings.get('resume_from_checkpoint')
    if run.flag('ignore_data_skip') and isinstance(checkpoint, str) and os.path.isfile(
            os.path.join(checkpoint, STATE_FILE)):
        raise ignore_data_skip_error(checkpoint)


def _epochs(run: LaunchRun) -> None:
    epochs, steps = run.number('num_train_epochs', 3), run.number('max_steps', -1)
    if (steps is None or steps <= 0) and epochs is not None and epochs <= 0:
        raise ConfigError(f'num_train_epochs: must be > 0 when max_steps is not set, got {epochs:g}')


def _rlhf(run: LaunchRun) -> None:
    _check_rlhf(run.pack, run.settings, run.configs, run.world_size)


def _sequence_parallel_rows(run: LaunchRun) -> None:
    """Sequence parallelism: ms-swift pads and splits every row across the group itself; the pack's own padding-free
    packing would hand it one packed row it does not expect (ring attention needs ms-swift's padding_free), and the
    noise probe's small-batch gradient is not one rank's under it."""
    size = run.number('sequence_parallel_size', 1) or 1
    if size <= 1:
        return
    length = run.configs.get('length_batching')
    if length is not None and length.padding_free:
        raise ConfigError(f'{SECTION}.length_batching.padding_free: true is not supported with sequence_parallel_size: '
                          f'{size:g} (ms-swift pads and splits each row across the group; for packed rows use '
                          'ms-swift\'s own padding_free); remove it')
    for name, _, _ in _noise_asks(run):
        raise ConfigError(f'{name} cannot be used with sequence_parallel_size: {size:g}: a pass\'s gradient on one '
                          'rank is not its rows\' under sequence parallelism; remove it')


def _vision_rows(run: LaunchRun) -> None:
    """A vision-language run (Qwen-VL or tiles rows): its rows carry images (Qwen-VL: and 3-D rotary positions) that
    the pack's own padding-free packing does not redo (the step runner refuses it at start too; here before the model
    loads)."""
    length = run.configs.get('length_batching')
    model = run.model
    if model.vision_rows and length is not None and length.padding_free:
        what = '3-D rotary positions and images' if model.qwen_vl else 'images'
        raise ConfigError(f'{SECTION}.length_batching.padding_free: true is not supported with {model.setting} (vision-'
                          f'language rows: {what} the pack\'s packing does not redo); remove it (passes are still cut '
                          'at the rows\' images), or use ms-swift\'s own padding_free with flash attention')


#: the launch rules :func:`check_run` applies in order, each a small named function of :class:`LaunchRun`
LAUNCH_RULES: tuple[Callable[[LaunchRun], None], ...] = (
    _split_passes_and_backoff, _run_facts, _stream_window, _packed_attention, _samples_unit, _packing, _rotation_limit,
    _eval_metrics, _lambda_scheduler, _noise_scale, _optimizer_scaling, _memory_probe, _group_by_length,
    _ignore_data_skip, _epochs, _rlhf, _vision_rows, _sequence_parallel_rows)


#: ``optim`` values whose param groups have no ``betas`` (HF's names; the rest are Adam-family or Lion)
NO_BETAS_OPTIMIZERS = ('sgd', 'adafactor', 'adagrad', 'rmsprop', 'rmsprop_bnb', 'rmsprop_bnb_8bit',
                       'rmsprop_bnb_32bit', 'lomo', 'adalomo', 'schedule_free_sgd')


def _check_optimizer_scaling(growth: Any, settings: Mapping[str, Any]) -> None:
    """batch_growth's optimizer rescaling needs what it scales: a weight decay > 0, an optimizer with betas."""
    if growth.weight_decay_scaling != 'none':
        decay = _number(settings, 'weight_decay', 0.1)  # ms-swift's default
        if not decay:
            raise ConfigError(f'{SECTION}.batch_growth.weight_decay_scaling: {growth.weight_decay_scaling} scales the '
                              f'weight decay with the batch, but weight_decay is {decay:g}: nothing would change; set '
                              'weight_decay > 0, or weight_decay_scaling: none')
    optim = str(settings.get('optim') or '').strip().lower()
    if growth.beta2_scaling != 'none' and optim in NO_BETAS_OPTIMIZERS:
        raise ConfigError(f'{SECTION}.batch_growth.beta2_scaling: {growth.beta2_scaling} sets Adam\'s beta2, but optim '
                          f'{optim} has no betas; use an Adam-family optimizer (adamw_torch, adamw_torch_fused, ...) '
                          'or beta2_scaling: none')


def group_by_length_error(processes: str) -> ConfigError:
    """HF's ``group_by_length`` under several processes (refused at launch and, as a second line, at start)."""
    return ConfigError(f'group_by_length: true is not supported with swift-dynamic-callbacks under several processes '
                       f'({processes}): the pack deals every rank its share of a seeded permutation and would not '
                       'group by length; set group_by_length: false and use callbacks: length_batching (length '
                       'buckets under a token budget) instead')


def ignore_data_skip_error(checkpoint: str) -> ConfigError:
    """HF's ``ignore_data_skip`` when resuming a checkpoint with the pack's state (refused at launch and at start)."""
    return ConfigError(f'ignore_data_skip: true cannot be honoured when resuming from {checkpoint}, a checkpoint with '
                       'the pack\'s state: the pack resumes at the next unseen sample of the epoch (its state holds '
                       'the position, the batch size and the decisions so far); remove ignore_data_skip, or start a '
                       'new run from the checkpoint\'s weights')


#: ``swift rlhf`` types the pack runs: one sample is a chosen/rejected pair (two padded rows) or, under KTO, a
#: completion with its KL row; their batches and token budgets count both rows (``rows.row_cost``)
def _check_rlhf(pack: PackConfig, settings: Mapping[str, Any], configs: Mapping[str, Any], world_size: int) -> None:
    """``rlhf_type`` (``swift rlhf``): :func:`.rules.rlhf_refusal`, the rule every route asks before the model loads."""
    message = rlhf_refusal(settings.get('rlhf_type'), list(configs), configs, pack.integration.oom_recovery,
                           grpo_pass_tokens=pack.integration.grpo_pass_tokens, get=settings.get,
                           world_size=world_size)
    if message is not None:
        raise ConfigError(message)


def _eval_monitors(configs: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    if 'early_stopping' in configs and configs['early_stopping'].on_eval:
        out.append(('early_stopping', 'monitor', configs['early_stopping'].monitor))
    if 'lr_schedule' in configs and configs['lr_schedule'].watches_eval:
        out.append(('lr_schedule', 'monitor', configs['lr_schedule'].monitor))
    rotation = configs.get('checkpoint_rotation')
    if rotation is not None and rotation.keep_best > 0 and rotation.metric.startswith('eval_'):
        out.append(('checkpoint_rotation', 'metric', rotation.metric))
    return out
