"""The settings a checkpoint was written with, held against the resumed run's: settings a later version renamed are
read under their new names (:func:`renamed_settings`), then each change is listed (:func:`settings_changes`).

A snapshot is ``{section: {setting: value}}`` with the normalised settings of the integration and of every pack
callback (``integrations.checkpoint`` writes it into the pack state, ``state.build_payload``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .integration import IntegrationConfig
from .pack import CALLBACK_CONFIGS


def renamed_settings(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """A settings snapshot with every setting a later version renamed under its new name (a checkpoint written
    before a rename resumes as the same settings)."""
    classes = {**CALLBACK_CONFIGS, 'integration': IntegrationConfig}
    out: dict[str, Any] = {}
    for section, values in snapshot.items():
        renamed = getattr(classes.get(section), 'renamed', {})
        if isinstance(values, Mapping) and renamed:
            values = {renamed.get(key, key): value for key, value in values.items()}
        out[section] = values
    return out


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any], *, ignore: Iterable[str] = ()
                     ) -> dict[str, list[Any]]:
    """``{dotted.key: [old, new]}`` for every setting that differs between two normalised settings snapshots
    (``{section: {setting: value}}``, ``old`` read under today's names); a section present in one only is one change.
    ``ignore``: dotted keys or whole sections that do not change training (logging)."""
    skip = set(ignore)
    old = renamed_settings(old)
    changes: dict[str, list[Any]] = {}
    for section in sorted(set(old) | set(new)):
        if section in skip:
            continue
        a, b = old.get(section), new.get(section)
        if a is None or b is None:
            changes[section] = [a, b]
            continue
        for key in sorted(set(a) | set(b)):
            dotted = f'{section}.{key}'
            if dotted not in skip and a.get(key) != b.get(key):
                changes[dotted] = [a.get(key), b.get(key)]
    return changes
