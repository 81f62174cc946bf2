"""Validated, frozen configuration dataclasses and their construction from YAML mappings.

Every config class is a ``@dataclass(frozen=True)`` whose ``__post_init__`` calls the ``check_*`` helpers
below, so a bad value fails at construction with a :class:`ConfigError` naming the setting, the value and what
is allowed. :func:`from_mapping` builds one from a YAML/JSON mapping and rejects unknown keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, TypeVar

T = TypeVar('T')


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the setting, the value and what is allowed."""


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f'{name}: expected an integer, got {value!r} ({type(value).__name__})')
    if minimum is not None and value < minimum:
        raise ConfigError(f'{name}: must be >= {minimum}, got {value}')
    if maximum is not None and value > maximum:
        raise ConfigError(f'{name}: must be <= {maximum}, got {value}')


def check_number(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> None:
    """A finite int/float in the interval from ``low`` to ``high`` (``*_open``: that end excluded)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = '(' if low_open else '[', ')' if high_open else ']'
        raise ConfigError(f'{name}: must be a number in {lo}{low}, {high}{hi}, got {value!r}')


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f'{name}: must be one of {", ".join(map(repr, allowed))}, got {value!r}')


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f'{name}: expected true or false, got {value!r}')


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, *, prefix: str) -> T:
    """Build config ``cls`` from a mapping, naming ``prefix.key`` in every error.

    Raises:
        ConfigError: unknown key, or a value the config class rejects.
    """
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f'{prefix}: expected a mapping of settings, got {mapping!r}')
    mapping = dict(mapping)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - fields)
    if unknown:
        raise ConfigError(f'{prefix}: unknown setting(s) {", ".join(unknown)}; allowed: {", ".join(sorted(fields))}')
    try:
        return cls(**mapping)
    except ConfigError as e:
        raise ConfigError(f'{prefix}.{e}') from None
    except TypeError as e:  # e.g. a value of the wrong shape reaching a converter
        raise ConfigError(f'{prefix}: {e}') from None


def to_mapping(config: Any) -> dict[str, Any]:
    """The JSON-serialisable settings of a config dataclass (for snapshots in checkpoints)."""
    return dataclasses.asdict(config)
