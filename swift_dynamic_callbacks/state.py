"""One mechanism for pack state in checkpoints.

Every stateful piece of the pack (each callback, and the integration itself) has a unique ``state_key`` and
``state_dict()`` / ``load_state_dict(state)``. The integration writes all of them, with a snapshot of the pack
configuration, into ``<checkpoint>/dynamic_callbacks_state.json`` before HF writes the rest of the checkpoint,
and restores them on ``--resume_from_checkpoint`` before ``on_train_begin``. HF's own ``ExportableState``
restore is not used: it rebuilds callbacks as ``cls(**args)``, which ms-swift's ``(args, trainer)``
callbacks cannot survive.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

STATE_FILE = 'dynamic_callbacks_state.json'
FORMAT_VERSION = 1


class StateError(RuntimeError):
    """A checkpoint's pack state is unreadable or inconsistent (integrity failure: the run must stop)."""


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


def build_payload(components: Iterable[Stateful], config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        'format': FORMAT_VERSION,
        'components': {c.state_key: c.state_dict() for c in components},
        'config': dict(config or {}),
    }


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
        StateError: the file exists but is not a valid pack state.
    """
    path = os.path.join(checkpoint_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            payload = json.load(f)
    except (OSError, ValueError) as e:
        raise StateError(f'cannot read pack state {path}: {e}') from e
    if not isinstance(payload, dict) or payload.get('format') != FORMAT_VERSION or not isinstance(
            payload.get('components'), dict):
        raise StateError(f'{path} is not a swift-dynamic-callbacks state file of format {FORMAT_VERSION}')
    return payload


def restore_components(components: Iterable[Stateful], payload: Mapping[str, Any]) -> list[str]:
    """Load each component's entry; return the ``state_key`` of components that had none (new since the save)."""
    states = payload['components']
    missing = []
    for component in components:
        if component.state_key in states:
            component.load_state_dict(states[component.state_key])
        else:
            missing.append(component.state_key)
    return missing
