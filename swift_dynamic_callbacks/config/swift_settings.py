"""ms-swift's own settings checked before launch, without importing ms-swift (no torch: ``check`` stays under a second).

ms-swift rejects an unknown YAML key only after the launch (``remaining_argv``), a value of the wrong type when its
argument parser runs, and a negative batch size later still (or never: HF takes ``-1`` in places). The pack's launch
check knows every field of ms-swift's argument dataclasses (``SftArguments``, ``RLHFArguments``, ``PretrainArguments``:
their names, types and choices) from a table generated from ms-swift (:func:`generate`, merged into ``swift_args.json``
beside this module: the union under transformers 5.19 and 4.57.6, the versions the pack runs with;
``tests/test_cli_check.py`` holds the table against the installed package),
and refuses before anything loads:

- a key (or flag) that is none of them, with the closest known names ("did you mean learning_rate");
- a value whose type the field cannot take (``per_device_train_batch_size: two``), or outside its choices;
- a value outside the range ms-swift or HF would reject later (:data:`RANGES`: batch sizes and
  ``gradient_accumulation_steps`` at least 1, ``learning_rate`` above 0, ...).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from functools import lru_cache
from typing import Any, Mapping

from . import ConfigError

TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'swift_args.json')
#: the argument classes by the command that parses them
COMMANDS = {'sft': 'SftArguments', 'pt': 'PretrainArguments', 'rlhf': 'RLHFArguments'}
#: keys ms-swift's YAML reader takes besides the argument fields (``ENV``: exported before the run)
YAML_KEYS = ('ENV', )

#: ``key -> (lowest, lowest allowed itself, highest or None)``: the ranges ms-swift or HF reject later (or misbehave
#: past); ``None`` (the fields' default where they have one) is always allowed
RANGES: dict[str, tuple[float, bool, float | None]] = {
    'per_device_train_batch_size': (1, True, None),
    'per_device_eval_batch_size': (1, True, None),
    'gradient_accumulation_steps': (1, True, None),
    'learning_rate': (0, False, None),
    'num_train_epochs': (0, False, None),
    'warmup_ratio': (0, True, 1),
    'weight_decay': (0, True, None),
    'max_grad_norm': (0, True, None),
    'max_length': (1, True, None),
    'logging_steps': (0, False, None),
    'save_steps': (0, False, None),
    'eval_steps': (0, False, None),
    'dataloader_num_workers': (0, True, None),
    'lora_rank': (1, True, None),
    'lora_alpha': (0, False, None),
    'lora_dropout': (0, True, 1),
    'num_generations': (1, True, None),
    'split_dataset_ratio': (0, True, 1),
    'label_smoothing_factor': (0, True, 1),
}


@lru_cache(maxsize=None)
def fields() -> dict[str, dict[str, Any]]:
    """``name -> {'type', 'optional', 'choices', 'commands'}`` of every ms-swift argument (the vendored table)."""
    with open(TABLE_FILE, encoding='utf-8') as f:
        return json.load(f)['fields']


def _kind_ok(value: Any, kind: str) -> bool:
    if kind == 'bool':
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in ('true', 'false'))
    if kind == 'int':
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == 'float':
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == 'str':
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if kind == 'list':
        return isinstance(value, (list, tuple, str, int, float))
    return True


def _suggest(key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.75)
    return f'; did you mean {" or ".join(close)}?' if close else ''


def check_swift_settings(settings: Mapping[str, Any], command: str) -> None:
    """Refuse a setting ms-swift's ``command`` (``sft``, ``pt``, ``rlhf``; ``check``: ``rlhf`` when ``rlhf_type``
    is set, else ``sft``) would reject after launch: an unknown key, a wrong type or choice, a value out of range.

    Raises:
        ConfigError: naming the setting, the value and what is allowed.
    """
    if command == 'check' or settings.get('rlhf_type') is not None:  # the pack's rlhf rules say the rest
        command = 'rlhf' if settings.get('rlhf_type') is not None else 'sft'
    table = fields()
    cls = COMMANDS.get(command, 'SftArguments')
    known = {name: spec for name, spec in table.items() if cls in spec['commands']}
    for key, value in settings.items():
        if key in YAML_KEYS:
            continue
        spec = known.get(key)
        if spec is None:
            other = [c for c in ('RLHFArguments', ) if key in table and c in table[key]['commands'] and c != cls]
            if other:
                raise ConfigError(f'{key}: a setting of swift rlhf, not of swift {command} (got {value!r}); set '
                                  'rlhf_type and run swift-dynamic rlhf, or remove it')
            raise ConfigError(f'{key}: not a setting of ms-swift\'s swift {command} (got {value!r})'
                              f'{_suggest(key, known)} — ms-swift would stop after launch with "remaining_argv"')
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple)) and spec['type'] != 'list' else [value]
        for one in values:
            if not _kind_ok(one, spec['type']):
                raise ConfigError(f'{key}: expected {"an" if spec["type"] == "int" else "a"} {spec["type"]}, got '
                                  f'{one!r}')
            if spec.get('choices') and str(one) not in spec['choices']:
                raise ConfigError(f'{key}: {one!r} is not one of {", ".join(spec["choices"])}'
                                  f'{_suggest(str(one), spec["choices"])}')
        if key in RANGES and _kind_ok(value, 'float'):
            low, inclusive, high = RANGES[key]
            number = float(value)
            if math.isnan(number) or number < low or (number == low and not inclusive) or (
                    high is not None and number > high):
                allowed = (f'{">=" if inclusive else ">"} {low:g}' + (f' and <= {high:g}' if high is not None else ''))
                raise ConfigError(f'{key}: must be {allowed}, got {value!r}')


def _describe(hint: Any) -> tuple[str, bool, list[str] | None]:
    """``(type, optional, choices)`` of a field's type hint (used by :func:`generate` only)."""
    import enum
    import typing
    args = [a for a in typing.get_args(hint)]
    origin = typing.get_origin(hint)
    optional = type(None) in args
    if origin is typing.Literal:
        values = [a for a in args if a is not None]
        kind = 'bool' if values and all(isinstance(v, bool) for v in values) else 'str'
        return kind, None in args, sorted(str(v) for v in values)
    if origin in (typing.Union, getattr(__import__('types'), 'UnionType', None)):
        members = [a for a in args if a is not type(None)]
        literals = [m for m in members if typing.get_origin(m) is typing.Literal]
        enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
        if literals and all(m is str or m in literals for m in members):
            return 'str', optional, None  # a Literal or any string
        if enums:
            return 'str', optional, sorted({str(v.value) for e in enums for v in e} | set())
        kinds = {_describe(m)[0] for m in members}
        if len(kinds) == 1:
            return kinds.pop(), optional, None
        return 'any', optional, None
    if origin in (list, tuple, typing.List) or hint in (list, tuple):
        return 'list', optional, None
    if origin in (dict, typing.Dict) or hint is dict:
        return 'any', optional, None
    for kind, cls in (('bool', bool), ('int', int), ('float', float), ('str', str)):
        if hint is cls:
            return kind, optional, None
    return 'any', optional, None


def generate() -> dict[str, Any]:
    """The table of ms-swift's argument fields from the installed ms-swift (imports it: for the table's test and
    ``python -m swift_dynamic_callbacks.config.swift_settings`` after an ms-swift upgrade)."""
    import dataclasses
    import importlib.metadata
    import typing

    import swift.arguments as arguments
    from swift.utils.utils import _patch_get_type_hints
    out: dict[str, dict[str, Any]] = {}
    for cls_name in sorted(set(COMMANDS.values())):
        cls = getattr(arguments, cls_name)
        with _patch_get_type_hints():
            hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind, optional, choices = _describe(hints.get(field.name, field.type))
            entry = out.setdefault(field.name, {'type': kind, 'optional': optional, 'choices': choices,
                                                'commands': []})
            entry['commands'].append(cls_name)
    return {'ms_swift': importlib.metadata.version('ms-swift'), 'fields': dict(sorted(out.items()))}


def merge(table: dict[str, Any], installed: dict[str, Any]) -> dict[str, Any]:
    """``table`` with the fields of ``installed`` (:func:`generate`) added: the union over the ms-swift and
    transformers versions the pack supports (a type two versions disagree on becomes ``any``; choices join, and a
    version without choices lifts them)."""
    fields_ = dict(table.get('fields', {}))
    for name, spec in installed['fields'].items():
        if name not in fields_:
            fields_[name] = spec
            continue
        known = dict(fields_[name])
        known['type'] = known['type'] if known['type'] == spec['type'] else 'any'
        known['commands'] = sorted(set(known['commands']) | set(spec['commands']))
        known['optional'] = bool(known['optional'] or spec['optional'])
        known['choices'] = (None if known['choices'] is None or spec['choices'] is None
                            else sorted(set(known['choices']) | set(spec['choices'])))
        fields_[name] = known
    return {**table, 'fields': dict(sorted(fields_.items()))}


if __name__ == '__main__':  # add the installed ms-swift's arguments to the table (after an upgrade, in each env)
    try:
        with open(TABLE_FILE, encoding='utf-8') as f:
            current = json.load(f)
    except FileNotFoundError:
        current = {}
    with open(TABLE_FILE, 'w', encoding='utf-8') as f:
        json.dump(merge(current, generate()), f, indent=0, sort_keys=True)
        f.write('\n')
    print(f'wrote {TABLE_FILE}')
