"""Validated, frozen configuration dataclasses and their construction from YAML mappings. No torch imported.

Every config class is a ``@dataclass(frozen=True)`` whose settings are declared with :func:`setting` and a
:class:`Check` (the type and the allowed values), and whose ``__post_init__`` calls :func:`validate`: every setting
is checked by its ``Check`` (a bad value fails at construction with a :class:`ConfigError` naming the setting, the
value and what is allowed), then :func:`check_reads` refuses settings the chosen policy / mode does not read (a
class's ``reads`` table), then the class's cross-setting rules run. :func:`from_mapping` builds one from a YAML/JSON
mapping and rejects unknown keys, and keys the chosen policy does not read even when they hold the default value.

The torch-free config modules beside this one (``batch_growth``, ``lr_schedule``, ..., ``pack``) are what the
command line imports; the callback modules import their config classes from there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, TypeVar

from ..errors import ConfigError

T = TypeVar('T')


# ---- single-value checks ----------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


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
    ok = _is_number(value) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = '(' if low_open else '[', ')' if high_open else ']'
        raise ConfigError(f'{name}: must be a finite number in {lo}{low}, {high}{hi}, got {value!r}')


def _same(value: Any, option: Any) -> bool:
    """Equal and of the same kind: ``1`` is not ``true``, ``'1'`` is not ``1``."""
    try:
        return type(value) is type(option) and value == option
    except Exception:  # noqa: BLE001 - an exotic value that cannot be compared is simply not an option
        return False


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if not any(_same(value, option) for option in allowed):
        raise ConfigError(f'{name}: must be one of {", ".join(map(yaml_repr, allowed))}, got {value!r}')


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f'{name}: expected true or false, got {value!r}')


def yaml_repr(value: Any) -> str:
    """A value as it is written in YAML (``true``, ``null``, ``'text'``, ``3``)."""
    if value is True:
        return 'true'
    if value is False:
        return 'false'
    if value is None:
        return 'null'
    return repr(value)


# ---- declared settings ------------------------------------------------------------------------------------


class Check:
    """How one setting is validated: ``check(name, value)`` returns the (normalised) value or raises
    :class:`ConfigError` naming ``name``, the value and what is allowed. ``optional``: ``None`` (YAML ``null``)
    is allowed and means "off" / "not set"."""

    optional: bool = False

    def __call__(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        return self.check(name, value)

    def check(self, name: str, value: Any) -> Any:
        raise NotImplementedError

    def _or_null(self) -> str:
        return ' or null' if self.optional else ''


@dataclass(frozen=True)
class Int(Check):
    """An integer (never a bool or a float) in ``[minimum, maximum]``."""

    minimum: int | None = None
    maximum: int | None = None
    optional: bool = False

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f'{name}: expected an integer{self._or_null()}, got {value!r} ({type(value).__name__})')
        check_int(name, value, minimum=self.minimum, maximum=self.maximum)
        return value


@dataclass(frozen=True)
class TokensOrAuto(Int):
    """An integer token budget in ``[minimum, maximum]``, or ``auto`` (chosen at train start from the device's free
    memory and the model's shape)."""

    def check(self, name: str, value: Any) -> Any:
        if value == 'auto':
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f'{name}: expected an integer >= {self.minimum}, auto{self._or_null()}, got {value!r} '
                              f'({type(value).__name__})')
        return super().check(name, value)


@dataclass(frozen=True)
class Number(Check):
    """A finite number (int or float, never a bool, NaN or infinity) in an interval."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    optional: bool = False

    def check(self, name: str, value: Any) -> Any:
        if not _is_number(value) or not math.isfinite(value):
            lo, hi = '(' if self.low_open else '[', ')' if self.high_open else ']'
            raise ConfigError(f'{name}: must be a finite number in {lo}{self.low}, {self.high}{hi}{self._or_null()}, '
                              f'got {value!r}')
        check_number(name, value, self.low, self.high, low_open=self.low_open, high_open=self.high_open)
        return value


@dataclass(frozen=True)
class Choice(Check):
    """One of ``options`` (compared with their type: ``1`` is not ``true``)."""

    options: tuple = ()

    def check(self, name: str, value: Any) -> Any:
        check_choice(name, value, self.options)
        return value


@dataclass(frozen=True)
class Flag(Check):
    """``true`` or ``false``."""

    def check(self, name: str, value: Any) -> Any:
        check_bool(name, value)
        return value


@dataclass(frozen=True)
class Text(Check):
    """A non-empty string (a metric name, a path); ``example`` goes into the message."""

    example: str = ''
    optional: bool = False

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, str) or not value.strip():
            hint = f' such as {self.example!r}' if self.example else ''
            raise ConfigError(f'{name}: expected a non-empty string{hint}{self._or_null()}, got {value!r}')
        return value


@dataclass(frozen=True)
class StepsOrFraction(Check):
    """Optimizer steps (an int >= 0) or a fraction of training (a float in [0, 1))."""

    def check(self, name: str, value: Any) -> Any:
        ok = _is_number(value) and math.isfinite(value) and value >= 0 and (isinstance(value, int) or value < 1)
        if not ok:
            raise ConfigError(f'{name}: expected optimizer steps (an int >= 0) or a fraction of training (a float in '
                              f'[0, 1)), got {value!r}')
        return value


def _int_key(key: Any) -> Any:
    if isinstance(key, str) and key.strip().isdigit():  # JSON object keys are strings
        return int(key)
    return key


@dataclass(frozen=True)
class IntTable(Check):
    """A mapping ``{int >= key_minimum: int >= value_minimum}`` (keys may be digit strings, as in JSON); returned
    as a dict sorted by key. ``what`` names the keys and values in messages (``step: batch_size``)."""

    value_minimum: int = 1
    key_minimum: int = 0
    what: str = 'step: value'

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ConfigError(f'{name}: expected a mapping {{{self.what}}}, got {value!r} ({type(value).__name__})')
        out: dict[int, int] = {}
        for key, item in value.items():
            key = _int_key(key)
            check_int(f'{name} key {key!r}', key, minimum=self.key_minimum)
            check_int(f'{name}[{key}]', item, minimum=self.value_minimum)
            out[key] = item
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class StageTable(Check):
    """A mapping ``{start: factor}``: starts all optimizer steps (ints >= 0) or all fractions of training (floats in
    [0, 1)), factors in (0, 1] (keys may be strings, as in JSON); returned as a dict sorted by start."""

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ConfigError(f'{name}: expected a mapping {{start: LR factor}} (start: optimizer steps or a fraction '
                              f'of training), got {value!r} ({type(value).__name__})')
        out: dict[int | float, float] = {}
        for key, item in value.items():
            if isinstance(key, str):
                try:
                    key = int(key) if key.strip().isdigit() else float(key)
                except ValueError:
                    raise ConfigError(f'{name} key {key!r}: expected optimizer steps or a fraction of '
                                      'training') from None
            StepsOrFraction().check(f'{name} key {key!r}', key)
            Number(0, 1, low_open=True).check(f'{name}[{key}]', item)
            out[key] = item
        if len({isinstance(k, int) for k in out}) > 1:
            raise ConfigError(f'{name}: starts must be all optimizer steps (ints) or all fractions of training '
                              f'(floats), got {sorted(out, key=float)}')
        return dict(sorted(out.items()))


def setting(check: Check, default: Any = dataclasses.MISSING, *,
            default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A dataclass field validated by ``check`` (read by :func:`validate`)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={'check': check})


def field_check(field: dataclasses.Field) -> Check | None:
    return field.metadata.get('check')


# ---- which settings a policy / mode reads -----------------------------------------------------------------


@dataclass(frozen=True)
class Reads:
    """Which settings each value of a *selector* setting reads (one row of a config class's ``reads`` table).

    ``by`` maps each selector value (or, with ``classify``, each class of values such as ``'>= 1'``) to the
    governed settings it reads; a setting named under no value is not governed (every value reads it). A governed
    setting that the configured value does not read must stay at its default: :func:`check_reads` refuses it,
    naming the setting, the values that read it and the configured value.
    """

    selector: str
    by: Mapping[Any, tuple[str, ...]]
    classify: Callable[[Any], Any] | None = None

    @property
    def governed(self) -> frozenset[str]:
        return frozenset(name for names in self.by.values() for name in names)

    def key(self, value: Any) -> Any:
        return self.classify(value) if self.classify is not None else value

    def readers(self, name: str) -> list[Any]:
        return [choice for choice, names in self.by.items() if name in names]


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # noqa: BLE001
        return True


def _normalised_default(cls: type, name: str, default: Any) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    check = field_check(f)
    return check(name, default) if check is not None else default


def check_reads(config: Any, given: Iterable[str] | None = None) -> None:
    """Refuse a setting the configured policy / mode does not read (the class's ``reads`` table).

    Args:
        config: a validated config dataclass instance.
        given: the keys the user wrote (YAML); ``None``: every setting whose value differs from its default.
    """
    cls = type(config)
    defaults = _defaults(cls)
    for row in getattr(cls, 'reads', ()):
        value = getattr(config, row.selector)
        reading = set(row.by.get(row.key(value), ()))
        for name in sorted(row.governed - reading):
            if given is not None:
                if name not in given:
                    continue
            elif not _differs(getattr(config, name), _normalised_default(cls, name, defaults.get(name))):
                continue
            readers = ' | '.join(str(yaml_repr(r) if not isinstance(r, str) else r) for r in row.readers(name))
            shown = yaml_repr(value) if not isinstance(value, str) else value
            raise ConfigError(f'{name}: only read by {row.selector}: {readers}; the configured {row.selector} is '
                              f'{shown} (remove {name}, or change {row.selector})')


def validate(config: Any) -> None:
    """Run every declared setting's :class:`Check` (normalised values are written back), then :func:`check_reads`
    (a setting nobody reads is reported as such, not as a clash with another), then the class's ``cross_checks()``
    (rules between settings)."""
    for f in dataclasses.fields(config):
        check = field_check(f)
        if check is None:
            continue
        value = getattr(config, f.name)
        checked = check(f.name, value)
        if checked is not value:
            object.__setattr__(config, f.name, checked)
    check_reads(config)
    cross = getattr(config, 'cross_checks', None)
    if cross is not None:
        cross()


class Settings:
    """Mixin of the pack's config dataclasses: ``__post_init__`` runs :func:`validate`.

    Class attributes: ``reads`` (the :class:`Reads` table), ``controls`` (the request flags a callback with this
    config sets whose value is last-wins — two callbacks sharing one are refused, see ``config.pack``).
    """

    reads: ClassVar[tuple[Reads, ...]] = ()
    controls: ClassVar[tuple[str, ...]] = ()
    #: old setting name -> its new name: the old one is still read (a note says so), both at once are refused
    renamed: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        validate(self)

    def renamed_notes(self) -> tuple[str, ...]:
        """What :func:`from_mapping` read under an old name (one note each)."""
        return getattr(self, '_renamed_notes', ())

    def cross_checks(self) -> None:
        """Rules between settings (override); single settings are checked by their :class:`Check`."""


# ---- YAML mappings ----------------------------------------------------------------------------------------


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, *, prefix: str) -> T:
    """Build config ``cls`` from a mapping, naming ``prefix.key`` in every error.

    Raises:
        ConfigError: unknown key, a key the configured policy does not read, or a value the class rejects.
    """
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f'{prefix}: expected a mapping of settings, got {mapping!r}')
    mapping = dict(mapping)
    bad_keys = [k for k in mapping if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f'{prefix}: setting names must be strings, got {bad_keys[0]!r}')
    notes = []
    for old, new in getattr(cls, 'renamed', {}).items():
        if old in mapping:
            if new in mapping:
                raise ConfigError(f'{prefix}.{old}: renamed {new}, and both are set ({mapping[old]!r}, '
                                  f'{mapping[new]!r}); set only {new}')
            mapping[new] = mapping.pop(old)
            notes.append(f'{prefix}.{old} is now called {new} (read as {new}: {mapping[new]!r}); rename it')
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - fields)
    if unknown:
        raise ConfigError(f'{prefix}: unknown setting(s) {", ".join(unknown)}; allowed: {", ".join(sorted(fields))}')
    try:
        config = cls(**mapping)
        check_reads(config, mapping)
        if notes:
            object.__setattr__(config, '_renamed_notes', tuple(notes))
        return config
    except ConfigError as e:
        raise ConfigError(f'{prefix}.{e}') from None
    except TypeError as e:  # e.g. a value of the wrong shape reaching a converter
        raise ConfigError(f'{prefix}: {e}') from None


def to_mapping(config: Any, *, changed_only: bool = False) -> dict[str, Any]:
    """The JSON-serialisable settings of a config dataclass (for snapshots in checkpoints); ``changed_only``: only
    the settings that differ from their defaults (what a user would write in YAML)."""
    values = dataclasses.asdict(config)
    if not changed_only:
        return values
    defaults = _defaults(type(config))
    return {k: v for k, v in values.items()
            if k not in defaults or _differs(getattr(config, k), _normalised_default(type(config), k, defaults[k]))}
