"""The pack's state in checkpoints: written beside HF's files, bound to its checkpoint, checked and restored on resume.

On save, every stateful piece (the integration, the loader of every rank, the callbacks) goes into
``dynamic_callbacks_state.json`` (:mod:`..state`) with the settings and a binding (run, step, samples seen, dataset
fingerprint) that HF's ``trainer_state.json`` then records. On resume, the state must belong to the checkpoint, the
settings must be the same (or each change is recorded under ``allow_config_change``), the dataset must be the same,
and the loader continues at the next unseen sample.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterable, Mapping

from .. import distributed
from ..config import to_mapping
from ..config.integration import IntegrationConfig
from ..config.launch import ignore_data_skip_error
from ..config.snapshot import settings_changes
from ..policies.data_plan import per_device_batch
from ..records import DecisionRecord
from ..state import (BINDING_KEY, STATE_FILE, StateError, binding_entry, build_payload, check_binding, file_digest,
                     new_run_id, read_state, restore_components, write_state)
from .decisions import Decisions
from .layout import Layout

logger = logging.getLogger('swift_dynamic_callbacks')

CONFIG_FILE = 'dynamic_callbacks_config.json'
#: settings that do not change what is trained: a resume may change them without ``allow_config_change``
LOGGING_SETTINGS = ('integration.record_samples', 'integration.log_values', 'integration.fail_fast',
                    'integration.allow_config_change', 'training_log')


class Checkpoints:
    """Saving and resuming the pack's state for one trainer.

    Args:
        trainer: the HF / ms-swift trainer (read: ``args``, ``state``, the callbacks' settings).
        config: the integration settings.
        pack_config: the whole ``dynamic_callbacks`` section (the snapshot written beside the run).
        decisions: where its records go.

    State: the run's identity (``run_id``, kept across resumes); while a resume starts, the checkpoint read and
    its binding.
    """

    def __init__(self, trainer: Any, config: IntegrationConfig, pack_config: dict[str, Any],
                 decisions: Decisions) -> None:
        self.trainer = trainer
        self.config = config
        self.pack_config = pack_config
        self.decisions = decisions
        self.run_id: str | None = None
        self.checkpoint: str | None = None  # the checkpoint this run resumes from
        self.payload: dict[str, Any] | None = None  # its pack state
        self.binding: dict[str, Any] | None = None  # the resumed state's binding (step, samples, dataset)

    def snapshot_config(self) -> dict[str, Any]:
        snapshot = dict(self.pack_config)
        snapshot['integration'] = to_mapping(self.config)
        return snapshot

    def write_config(self) -> None:
        """Write the settings of this run beside it (``dynamic_callbacks_config.json``, rank 0)."""
        if distributed.is_main_process():
            output_dir = self.trainer.args.output_dir
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, CONFIG_FILE), 'w', encoding='utf-8') as f:
                json.dump(self.snapshot_config(), f, indent=1, sort_keys=True, default=str)

    def settings_snapshot(self) -> dict[str, Any]:
        """Normalised settings of the integration and of every pack callback on the trainer (compared at resume)."""
        from ..callbacks.base import DynamicCallback
        snapshot = {'integration': to_mapping(self.config)}
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, DynamicCallback) and dataclasses.is_dataclass(cb.config):
                snapshot[cb.name] = json.loads(json.dumps(to_mapping(cb.config), default=str))
        return snapshot

    # ---- resume -------------------------------------------------------------------------------------------
    def resume(self, resume_from_checkpoint: Any, components: Iterable[Any]) -> None:
        """At train start: find the checkpoint HF resumes from, check its pack state and restore ``components``
        (the integration and the callbacks; the loader is restored when it is built, :meth:`restore_loader`)."""
        checkpoint = resume_from_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = None
            if resume_from_checkpoint:
                from transformers.trainer_utils import get_last_checkpoint
                checkpoint = get_last_checkpoint(self.trainer.args.output_dir)
        self.checkpoint = checkpoint
        self.payload = read_state(checkpoint) if checkpoint else None
        self.run_id = new_run_id()
        if not checkpoint or self.payload is None:
            return
        self._check_state(checkpoint, self.payload)
        missing = restore_components(list(components), self.payload, source=os.path.join(checkpoint, STATE_FILE),
                                     intact=self.binding is not None)
        for key in missing:
            self.decisions.write(DecisionRecord('integration', 'resume', 'new_component', {'state_key': key},
                                                f'{key} has no state in {checkpoint}; it starts fresh'))

    def resumed_without_loader(self) -> None:
        """A run whose trainer draws its own batches (GRPO, GKD) resumed: one ``resume`` record naming the checkpoint
        and the restored components (the data position is the trainer's own: ms-swift resumes its sampler)."""
        if self.checkpoint and self.payload is not None:
            components = sorted(self.payload['components'])
            self.decisions.write(DecisionRecord(
                'integration', 'resume', 'checkpoint', {'checkpoint': os.path.basename(self.checkpoint),
                                                        'components': components},
                f'resumed from {self.checkpoint}: the pack\'s state restored ({", ".join(components)}); the data '
                'position is the trainer\'s own'))

    def _check_state(self, checkpoint: str, payload: Mapping[str, Any]) -> None:
        """Refuse a state that does not belong to ``checkpoint`` and settings that changed since it was written
        (unless ``allow_config_change``, then each change is a ``config_change`` record)."""
        binding = check_binding(checkpoint, payload)
        if binding is None:
            self.decisions.write(DecisionRecord(
                'integration', 'resume', 'unbound', {'checkpoint': os.path.basename(checkpoint)},
                'the pack state was written by an earlier version (format 1): it is not bound to its checkpoint and '
                'its settings are not compared'))
            return
        self.binding = binding
        self.run_id = binding.get('run_id') or self.run_id
        if 'settings' not in payload:
            return
        changes = settings_changes(payload['settings'], self.settings_snapshot(), ignore=LOGGING_SETTINGS)
        if not changes:
            return
        listed = '; '.join(f'{k}: {old!r} -> {new!r}' for k, (old, new) in changes.items())
        if not self.config.allow_config_change:
            raise StateError(f'the settings changed since {checkpoint} was written ({listed}); the resumed run would '
                             'silently train otherwise than the saved one. Resume with the same settings, or set '
                             'dynamic_callbacks.integration.allow_config_change: true to apply the new ones (each '
                             'change is then recorded)')
        for key, (old, new) in changes.items():
            self.decisions.write(DecisionRecord(
                'integration', 'config_change', 'resume', {'setting': key, 'old': old, 'new': new},
                f'{key} changed at resume: {old!r} -> {new!r} (allow_config_change)'))

    def restore_loader(self, loader: Any, fingerprint: Mapping[str, Any], layout: Layout) -> None:
        """Put a freshly built loader at the resumed checkpoint's data position (this rank's); on another number of
        processes or another ``gradient_accumulation_steps``, the samples left in the epoch re-dealt
        (:meth:`_redeal`)."""
        checkpoint = self.checkpoint
        if not checkpoint:
            return
        payload = self.payload
        if payload is not None and loader.state_key in payload['components']:
            if self.trainer.args.ignore_data_skip:
                raise ignore_data_skip_error(checkpoint)
            self._check_same_data(checkpoint, fingerprint)
            states = _rank_states(payload['components'], loader.state_key)
            saved_sp = int((payload['components'].get('integration') or {}).get('sequence_parallel_size', 1) or 1)
            if saved_sp != distributed.sequence_parallel_size():
                raise StateError(f'{os.path.join(checkpoint, STATE_FILE)} was written with sequence_parallel_size '
                                 f'{saved_sp} and is resumed with {distributed.sequence_parallel_size()}: the ranks of '
                                 'a group hold the same samples, so its data position cannot be re-dealt over another '
                                 'grouping; resume with the same sequence_parallel_size')
            if self._redeal(loader, states, layout):
                return
            restore_components([loader], {'components': {loader.state_key: states[distributed.rank()]}},
                               source=os.path.join(checkpoint, STATE_FILE), intact=self.binding is not None)
            self.decisions.write(DecisionRecord('integration', 'resume', 'checkpoint', {
                'checkpoint': os.path.basename(checkpoint), 'epoch': loader.epoch, 'position': loader.position,
                'batch_size': loader.batch_size, 'num_pieces': loader.num_pieces}, 'resumed at the next unseen sample'))
            return
        # A checkpoint written without the pack: the batch size never changed, so HF's batch arithmetic holds.
        state_file = os.path.join(checkpoint, 'trainer_state.json')
        if self.trainer.args.ignore_data_skip or not os.path.exists(state_file):
            return
        with open(state_file, encoding='utf-8') as f:
            global_step = int(json.load(f).get('global_step', 0))
        loader.skip_to(global_step * loader.batch_size * loader.entries_per_step)
        self.decisions.write(DecisionRecord(
            'integration', 'resume', 'no_pack_state',
            {'global_step': global_step, 'epoch': loader.epoch, 'position': loader.position},
            f'{checkpoint} has no pack state; position derived from global_step at a constant batch size'))

    def _redeal(self, loader: Any, states: list[Mapping[str, Any]], layout: Layout) -> bool:
        """Resume ``loader`` from every saved rank's rest of the epoch when the layout changed (processes, micro-batches
        a step) or the epoch was re-dealt before; keep the global batch. Returns whether it did; writes the
        ``elastic_resume`` record."""
        world, entries = distributed.world_size(), loader.entries_per_step
        old_world = len(states)
        old_entries = int(states[0].get('entries_per_step', entries))
        if (old_world, old_entries) == (world, entries) and not states[0].get('redealt'):
            return False
        source = os.path.join(self.checkpoint, STATE_FILE)
        if distributed.sequence_parallel_size() > 1:
            raise StateError(f'{source} was written by {old_world} processes with {old_entries} micro-batches a step '
                             f'and is resumed by {world} with {entries}: under sequence parallelism resume with the '
                             'same number of processes and gradient_accumulation_steps')
        if not loader.has_length:
            raise StateError(f'{source} was written by {old_world} processes and is resumed by {world}: a stream is '
                             'read rank::world, so its position cannot be re-dealt; resume a streaming run with the '
                             'same number of processes')
        if layout.world is None:  # a checkpoint from before the layout was saved: the one it was written in
            layout.world, layout.entries = old_world, old_entries
        old_batch = int(states[0]['batch_size'])
        global_batch = old_batch * old_entries * old_world
        batch_size, exact = per_device_batch(global_batch, world, entries)
        try:
            dealt = loader.resume_from_rests(states, rank=distributed.rank(), world=world, batch_size=batch_size)
        except StateError as e:
            raise StateError(f'{source}: {e}') from e
        if (old_world, old_entries) == (world, entries):
            return True  # an epoch re-dealt at an earlier resume, resumed as it was saved: nothing new to record
        kept = 'kept' if exact else f'not divisible: {batch_size * entries * world} samples a step now'
        message = (f'resumed on {world} process(es) with {entries} micro-batches a step from a checkpoint of '
                   f'{old_world} with {old_entries}: the {dealt["left_in_epoch"]} samples left in epoch '
                   f'{dealt["epoch"]} re-dealt rank::{world} (none repeated or skipped); per-device batch '
                   f'{old_batch} -> {batch_size}, global batch {global_batch} {kept}')
        if not exact:
            logger.warning('swift-dynamic-callbacks: %s', message)
        self.decisions.write(DecisionRecord('integration', 'elastic_resume', 'layout', {
            'checkpoint': os.path.basename(self.checkpoint), 'old_world': old_world, 'new_world': world,
            'old_entries': old_entries, 'new_entries': entries, 'old_batch_size': old_batch,
            'new_batch_size': batch_size, 'old_global_batch': global_batch,
            'new_global_batch': batch_size * entries * world, 'global_batch_kept': exact,
            'samples_seen': sum(int(s.get('samples_seen', 0)) for s in states), **dealt,
            'dealt': 'the ranks\' unconsumed samples interleaved in their order, dealt rank::world'}, message))
        return True

    def _check_same_data(self, checkpoint: str, now: Mapping[str, Any]) -> None:
        """Refuse a resume over another training dataset than the one the checkpoint's position counts in."""
        saved = (self.binding or {}).get('dataset')
        if not saved:
            return
        if saved.get('size') != now['size'] or (saved.get('sha256') and now['sha256']
                                                  and saved['sha256'] != now['sha256']):
            what = (f'{saved.get("size")} samples then, {now["size"]} now' if saved.get('size') != now['size'] else
                    'the same number of samples, other content')
            raise StateError(f'{checkpoint} was written for another training dataset ({what}): its data position would '
                             'point at other samples. Resume with the same dataset and preprocessing (dataset files, '
                             'max_length, dataset_seed, split_dataset_ratio)')

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, checkpoint_dir: str, integration: Any, loader: Any, callbacks: Iterable[Any],
             fingerprint: Mapping[str, Any] | None) -> None:
        """Write the state of the integration, of every rank's ``loader`` and of the stateful ``callbacks`` into
        ``checkpoint_dir`` (rank 0), before HF writes the rest of the checkpoint. Collective (the loaders' states are
        gathered)."""
        # each rank's data position (its own shard and plan), gathered on every rank before rank 0 writes
        loader_ranks = distributed.gather_objects(loader.state_dict()) if loader is not None else []
        if not (self.trainer.args.should_save and distributed.is_main_process()):
            return
        components = [integration] + ([loader] if loader is not None else []) + list(callbacks)
        binding = {'run_id': self.run_id, 'global_step': self.trainer.state.global_step,
                   'samples_seen': sum(int(state.get('samples_seen', 0)) for state in loader_ranks),
                   'dataset': fingerprint}
        payload = build_payload(components, self.snapshot_config(), binding=binding, settings=self.settings_snapshot())
        if len(loader_ranks) > 1:
            payload['components'][f'{loader.state_key}.ranks'] = loader_ranks
        path = write_state(checkpoint_dir, payload)
        # HF writes trainer_state.json after this: the entry binds the state file to this checkpoint (check_binding)
        self.trainer.state.stateful_callbacks[BINDING_KEY] = binding_entry(payload, file_digest(path))


def _rank_states(components: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    """Every saved rank's entry of a per-rank state (``<key>.ranks``: several processes), else ``[key's entry]``."""
    return list(components.get(f'{key}.ranks') or [components[key]])
