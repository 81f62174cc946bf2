"""One mechanism for pack state in checkpoints.

Every stateful piece of the pack (each callback, and the integration itself) has a unique ``state_key`` and
``state_dict()`` / ``load_state_dict(state)``. The integration writes all of them, with a snapshot of the pack
configuration, into ``<checkpoint>/dynamic_callbacks_state.json`` before HF writes the rest of the checkpoint,
and restores them on ``--resume_from_checkpoint`` before ``on_train_begin``. HF's own ``ExportableState``
restore is not used: it rebuilds callbacks as ``cls(**args)``, which ms-swift's ``(args, trainer)``
callbacks cannot survive.

A state belongs to its checkpoint (:func:`check_binding`): the file records the run it was written by (``run_id``),
the optimizer step and the samples seen, and the checkpoint's ``trainer_state.json`` (which HF writes after it)
records the run, the step and the file's SHA-256 under ``stateful_callbacks[BINDING_KEY]``. A state file copied from
another step or another run into a checkpoint no longer matches and is refused: used, it would skip or repeat samples.
The settings it was written with are saved in it too (``settings``); the resumed run compares them with its own
(:mod:`swift_dynamic_callbacks.config.snapshot`).
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
import os
import sys
import uuid
import zlib
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from .errors import StateError

STATE_FILE = 'dynamic_callbacks_state.json'
FORMAT_VERSION = 2
#: format 1 files (written before states were bound to their checkpoint) are still read
READABLE_FORMATS = (1, 2)
#: the key of the pack's entry in ``trainer_state.json``'s ``stateful_callbacks``
BINDING_KEY = 'SwiftDynamicCallbacks'


@runtime_checkable
class Stateful(Protocol):
    state_key: str

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ...


def stateful_components(objects: Iterable[Any]) -> list[Stateful]:
    """The objects that implement :class:`Stateful`, checking that their ``state_key`` is unique."""
    found: dict[str, Any] = {}
    for obj in objects:
        if isinstance(obj, Stateful):
            if obj.state_key in found and found[obj.state_key] is not obj:
                raise StateError(f'two stateful pack components share state_key {obj.state_key!r}: '
                                 f'{type(found[obj.state_key]).__name__} and {type(obj).__name__}')
            found[obj.state_key] = obj
    return list(found.values())


def build_payload(components: Iterable[Stateful], config: Mapping[str, Any] | None = None, *,
                  binding: Mapping[str, Any] | None = None, settings: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The state file's content: every component's state, the configuration snapshot (as written in YAML), the
    ``binding`` (``run_id``, ``global_step``, ``samples_seen``, ``dataset``) and the normalised ``settings`` that a
    resume compares with its own."""
    payload = {
        'format': FORMAT_VERSION,
        'components': {c.state_key: c.state_dict() for c in components},
        'config': dict(config or {}),
    }
    if binding is not None:
        payload['binding'] = dict(binding)
    if settings is not None:
        payload['settings'] = dict(settings)
    return payload


def new_run_id() -> str:
    """A fresh identity for a training run (kept across its resumes)."""
    return uuid.uuid4().hex[:16]


def file_digest(path: str | os.PathLike) -> str:
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def binding_entry(payload: Mapping[str, Any], digest: str) -> dict[str, Any]:
    """What goes in ``trainer_state.json`` (``stateful_callbacks[BINDING_KEY]``) for a state file with ``payload``
    whose SHA-256 is ``digest``. Shaped like HF's exported callback states (``args`` / ``attributes``)."""
    binding = payload.get('binding') or {}
    return {'args': {}, 'attributes': {'run_id': binding.get('run_id'), 'global_step': binding.get('global_step'),
                                       'state_sha256': digest}}


def check_binding(checkpoint_dir: str | os.PathLike, payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """Refuse a state file that was not written with this checkpoint; return its binding (``None``: format 1).

    Raises:
        StateError: the checkpoint's ``trainer_state.json`` has no pack entry, or its run, step or file digest differ
            from the state file's (a file copied from another step or run), naming both.
    """
    path = os.path.join(checkpoint_dir, STATE_FILE)
    binding = payload.get('binding')
    if payload.get('format') == 1 or binding is None:
        return None
    trainer_state = os.path.join(checkpoint_dir, 'trainer_state.json')
    try:
        with open(trainer_state, encoding='utf-8') as f:
            hf_state = json.load(f)
    except (OSError, ValueError) as e:
        raise StateError(f'{path}: cannot check that it belongs to its checkpoint: {trainer_state}: {e}') from e
    entry = ((hf_state.get('stateful_callbacks') or {}).get(BINDING_KEY) or {}).get('attributes')
    step = hf_state.get('global_step')
    if entry is None:
        raise StateError(f'{path} was not written with this checkpoint: {trainer_state} (step {step}) has no '
                         f'{BINDING_KEY} entry. Resuming with a state copied from another checkpoint would skip or '
                         'repeat samples; resume from the checkpoint it was written in')
    found = {'run_id': binding.get('run_id'), 'global_step': binding.get('global_step'),
             'state_sha256': file_digest(path)}
    expected = {'run_id': entry.get('run_id'), 'global_step': step, 'state_sha256': entry.get('state_sha256')}
    differs = [k for k in found if found[k] != expected[k]]
    if differs:
        details = ', '.join(f'{k}: state file {found[k]!r}, checkpoint {expected[k]!r}' for k in differs)
        raise StateError(f'{path} does not belong to its checkpoint ({details}): it was written at another step or '
                         'by another run (or edited). Used, it would skip or repeat samples; resume from the '
                         'checkpoint it was written in')
    return dict(binding)


def write_state(checkpoint_dir: str | os.PathLike, payload: Mapping[str, Any]) -> str:
    """Write the payload atomically (temporary file + rename) and return its path."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, STATE_FILE)
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
        json.dump(payload, f, indent=1, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The payload of a checkpoint, or ``None`` when the checkpoint was written without the pack.

    Raises:
        StateError: the file exists but is not a valid pack state, or it is missing while the checkpoint's
            ``trainer_state.json`` says the pack wrote one (resumed without it, samples would be skipped or repeated).
    """
    path = os.path.join(checkpoint_dir, STATE_FILE)
    if not os.path.exists(path):
        if _names_pack_state(checkpoint_dir):
            raise StateError(
                f'{path} is missing, but {os.path.join(checkpoint_dir, "trainer_state.json")} names the pack state '
                f'({BINDING_KEY} under stateful_callbacks): the checkpoint was written with the pack and its data '
                'position, batch size and callback states are in that file. Restore the file from a copy of the '
                f'checkpoint; to resume anyway on purpose, delete the {BINDING_KEY} entry from trainer_state.json: '
                'the run then resumes like a plain checkpoint (position from global_step at the current batch size, '
                'exact only if the batch size never changed; callbacks start fresh)')
        return None
    try:
        with open(path, encoding='utf-8') as f:
            payload = json.load(f)
    except (OSError, ValueError) as e:
        raise StateError(f'cannot read pack state {path}: {e}') from e
    if not isinstance(payload, dict) or payload.get('format') not in READABLE_FORMATS or not isinstance(
            payload.get('components'), dict):
        raise StateError(f'{path} is not a swift-dynamic-callbacks state file of format {FORMAT_VERSION}')
    return payload


def _names_pack_state(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether the checkpoint's ``trainer_state.json`` has the pack's entry (written with every pack state)."""
    try:
        with open(os.path.join(checkpoint_dir, 'trainer_state.json'), encoding='utf-8') as f:
            hf_state = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(hf_state, dict) and BINDING_KEY in (hf_state.get('stateful_callbacks') or {})


def restore_components(components: Iterable[Stateful], payload: Mapping[str, Any], *, source: str = STATE_FILE,
                       intact: bool = False) -> list[str]:
    """Load each component's entry; return the ``state_key`` of components that had none (new since the save).

    ``intact``: the file is known to be the one the pack wrote with its checkpoint (its digest matched the
    checkpoint's binding, :func:`check_binding`), so an entry that does not load is the pack's own defect, not a
    damaged file, and the error says so.

    Raises:
        StateError: an entry that does not load (a missing field, a value of the wrong type or range), naming
            ``source``, the component and the error.
    """
    states = payload['components']
    missing = []
    for component in components:
        if component.state_key not in states:
            missing.append(component.state_key)
            continue
        state = states[component.state_key]
        try:
            if not isinstance(state, Mapping):
                raise TypeError(f'expected a mapping, got {type(state).__name__}')
            component.load_state_dict(state)
        except StateError as e:
            raise StateError(f'{source}: {component.state_key}: {e}') from e
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError) as e:
            what = f'missing field {e}' if isinstance(e, KeyError) else f'{type(e).__name__}: {e}'
            if intact:
                raise StateError(f'{source}: {component.state_key}: {what}. The file is intact (its digest matches '
                                 'the checkpoint\'s trainer_state.json): swift-dynamic-callbacks wrote a state it '
                                 'cannot read back, a defect of the pack; please report it with this file') from e
            raise StateError(f'{source}: {component.state_key}: {what} (a corrupt or edited state file; resume '
                             'from an intact checkpoint)') from e
    return missing


def pack_indices(indices: Sequence[int]) -> str:
    """A list of dataset indices as compact text for a state file (zlib-compressed little-endian uint32, base64)."""
    values = array.array('I', indices)
    if sys.byteorder == 'big':
        values.byteswap()
    return base64.b64encode(zlib.compress(values.tobytes(), 6)).decode('ascii')


def unpack_indices(text: str) -> list[int]:
    """The indices :func:`pack_indices` wrote.

    Raises:
        StateError: the text is not such a list."""
    try:
        data = zlib.decompress(base64.b64decode(text.encode('ascii'), validate=True))
    except (ValueError, zlib.error, AttributeError) as e:
        raise StateError(f'corrupt index list in the pack state: {e}') from e
    if len(data) % 4:
        raise StateError(f'corrupt index list in the pack state: {len(data)} bytes is not a whole number of indices')
    values = array.array('I')
    values.frombytes(data)
    if sys.byteorder == 'big':
        values.byteswap()
    return values.tolist()
