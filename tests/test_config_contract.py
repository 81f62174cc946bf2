"""Contract tests over every setting of every config class (enumerated with ``dataclasses.fields``, so a new setting is
covered as soon as it is declared with a ``Check``): wrong types, NaN / inf and out-of-range values are refused with
an error naming the setting and the value; valid values round-trip through YAML / JSON; every ``reads`` table is
exercised over all its combinations; controls conflicts are derived from the declared ``controls``."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.config import (Choice, ConfigError, Flag, Int, IntTable, Number, StageTable,
                                            StepsOrFraction, Text, field_check, from_mapping, to_mapping)
from swift_dynamic_callbacks.config.batch_growth import BatchGrowthConfig, FunctionRef
from swift_dynamic_callbacks.config.integration import IntegrationConfig
from swift_dynamic_callbacks.config.length_batching import LengthRules
from swift_dynamic_callbacks.config.memory_backoff import MemoryBackoffConfig
from swift_dynamic_callbacks.config.pack import CALLBACK_CONFIGS, check_controls, parse_section
from swift_dynamic_callbacks.config.training_log import FileName

CLASSES = {**CALLBACK_CONFIGS, 'integration': IntegrationConfig}
FIELDS = [(name, f.name) for name, cls in CLASSES.items() for f in dataclasses.fields(cls) if f.init]


def grow(step, batch_size):
    return batch_size


FUNCTION = f'{__name__}:grow'

#: Settings that a selector value needs beside it (the class refuses the selector value without them).
COMPANIONS = {
    ('batch_growth', 'policy', 'table'): {'table': {0: 2}},
    ('batch_growth', 'policy', 'callable'): {'function': FUNCTION},
    ('memory_backoff', 'probe', 'cpu'): {'cpu_budget_gib': 8.0},
    ('length_batching', 'split', 'passes'): {'bucketing': False},
    ('lr_schedule', 'decay', 'steps'): {'steps': {0.5: 0.1}, 'max_restarts': 0},
    # a selector that only one policy reads: its values need that policy beside them
    ('batch_growth', 'switch_patience', 1): {'policy': 'late_switch'},
    ('batch_growth', 'switch_patience', None): {'policy': 'late_switch'},
}
#: Settings a class always needs (no useful default).
BASE = {'batch_schedule': {'schedule': {0: 2}}}


def companions(section, name, value):
    try:
        return COMPANIONS.get((section, name, value), {})
    except TypeError:  # an unhashable value (a table) is no selector value
        return {}


#: Rules between two settings: a single random valid value may break them (the message names both).
CROSS = {'maximum', 'initial', 'low', 'threshold', 'guard_low', 'guard_high', 'divergence'}

# ---- strategies from the declared checks ----------------------------------------------------------------------

BIG = 10**9
text = st.text(min_size=1, max_size=12).filter(lambda s: s.strip() != '')
junk = st.one_of(st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


def valid(check):
    """Values ``check`` accepts."""
    if isinstance(check, Int):
        value = st.integers(check.minimum if check.minimum is not None else -BIG,
                            check.maximum if check.maximum is not None else BIG)
    elif isinstance(check, Number):
        lo, hi = max(check.low, -1e9), min(check.high, 1e9)
        value = st.floats(lo, hi, exclude_min=check.low_open, exclude_max=check.high_open, allow_nan=False,
                          allow_infinity=False)
    elif isinstance(check, Choice):
        value = st.sampled_from(check.options)
    elif isinstance(check, Flag):
        value = st.booleans()
    elif isinstance(check, Text):
        value = text
    elif isinstance(check, FileName):
        value = text.filter(lambda s: not s.endswith('/'))
    elif isinstance(check, StepsOrFraction):
        value = st.one_of(st.integers(0, BIG), st.floats(0, 1, exclude_max=True))
    elif isinstance(check, IntTable):
        value = st.dictionaries(st.integers(check.key_minimum, 10**6), st.integers(check.value_minimum, 10**6),
                                min_size=1, max_size=4)
    elif isinstance(check, StageTable):
        factor = st.floats(0, 1, exclude_min=True, allow_nan=False)
        value = st.one_of(st.dictionaries(st.integers(0, 10**6), factor, min_size=1, max_size=4),
                          st.dictionaries(st.floats(0, 1, exclude_max=True), factor, min_size=1, max_size=4))
    elif isinstance(check, LengthRules):
        value = st.dictionaries(st.integers(1, 10**5), st.integers(1, 64), max_size=3).flatmap(
            lambda rest: st.integers(1, 64).map(lambda first: {0: first, **rest}))
    elif isinstance(check, FunctionRef):
        value = st.just(FUNCTION)
    else:
        raise AssertionError(f'no strategy for {type(check).__name__}: add one (a new kind of setting)')
    return st.one_of(st.none(), value) if check.optional else value


def invalid(check):
    """Values of the wrong type, non-finite numbers and out-of-range values for ``check``."""
    none = [] if check.optional else [st.none()]
    if isinstance(check, Int):
        bad = [st.booleans(), text, st.floats().filter(lambda v: not float(v).is_integer() or not math.isfinite(v)),
               non_finite, junk]
        if check.minimum is not None:
            bad.append(st.integers(check.minimum - BIG, check.minimum - 1))
        if check.maximum is not None:
            bad.append(st.integers(check.maximum + 1, check.maximum + BIG))
    elif isinstance(check, Number):
        bad = [st.booleans(), text, non_finite, junk]
        if math.isfinite(check.low):
            bad.append(st.floats(check.low - 1e6, check.low, exclude_max=not check.low_open))
        if math.isfinite(check.high):
            bad.append(st.floats(check.high, check.high + 1e6, exclude_min=not check.high_open))
    elif isinstance(check, Choice):
        bad = [text.filter(lambda s: s not in check.options), st.integers(), st.floats(), junk]
    elif isinstance(check, Flag):
        bad = [st.integers(), st.sampled_from(['true', 'yes', 'false', '1']), st.floats(), junk]
    elif isinstance(check, (Text, FileName)):
        bad = [st.integers(), st.floats(), st.booleans(), st.sampled_from(['', '   ']), junk]
    elif isinstance(check, StepsOrFraction):
        bad = [st.booleans(), text, non_finite, st.integers(-BIG, -1), st.floats(1, 1e6, exclude_min=True), junk]
    elif isinstance(check, IntTable):
        bad = [st.integers(), st.booleans(), text, st.lists(st.integers(), max_size=3),
               st.just({0: check.value_minimum - 1}), st.just({0: 2.5}), st.just({0: True}),
               st.just({check.key_minimum - 1: 2}), st.just({'x': 2})]
    elif isinstance(check, StageTable):
        bad = [st.integers(), st.booleans(), text, st.lists(st.integers(), max_size=3), st.just({0.5: 0.0}),
               st.just({0.5: 1.5}), st.just({0.5: math.nan}), st.just({1.5: 0.5}), st.just({-1: 0.5}),
               st.just({'x': 0.5}), st.just({0.5: 0.5, 10: 0.1}), st.just({0.5: True})]
    elif isinstance(check, LengthRules):
        bad = [st.integers(), st.booleans(), text, st.just({}), st.just({512: 4}), st.just({0: 0}),
               st.just({0: math.nan}), st.just([[0]])]
    elif isinstance(check, FunctionRef):
        bad = [st.integers(), st.floats(), st.booleans(), st.sampled_from(['nocolon', ':fn', 'mod:']), junk]
    else:
        raise AssertionError(f'no strategy for {type(check).__name__}')
    return st.one_of(*bad, *none)


def check_of(cls, name):
    return field_check(next(f for f in dataclasses.fields(cls) if f.name == name))


def reading_selector(section, cls, name) -> dict:
    """Settings that make ``name`` read: for a governed setting, a selector value that reads it (+ companions)."""
    out = {}
    for row in cls.reads:
        if name in row.governed:
            choice = row.readers(name)[0]
            value = representative(row, choice)
            out[row.selector] = value
            out.update(COMPANIONS.get((section, row.selector, value), {}))
    return out


def representative(row, choice):
    if row.classify is None:
        return choice
    for value in (0, 1, 2, 5, None):  # None: an optional setting off
        try:
            if row.classify(value) == choice:
                return value
        except TypeError:  # a classifier of numbers only
            continue
    raise AssertionError(f'no representative value of {row.selector} for {choice!r}')


# ---- every setting ---------------------------------------------------------------------------------------------


def test_every_setting_declares_a_check():
    for section, name in FIELDS:
        assert check_of(CLASSES[section], name) is not None, f'{section}.{name} has no Check (use config.setting)'


@pytest.mark.parametrize('section,name', FIELDS, ids=[f'{s}.{n}' for s, n in FIELDS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_bad_value_is_refused_naming_the_setting_and_the_value(section, name, data):
    cls = CLASSES[section]
    check = check_of(cls, name)
    bad = data.draw(invalid(check), label=name)
    with pytest.raises(ConfigError) as info:
        cls(**{name: bad})
    message = str(info.value)
    assert message.split(':')[0].split('[')[0].split(' ')[0] == name, message
    if not isinstance(bad, (dict, list)):
        assert repr(bad) in message or (isinstance(bad, float) and math.isnan(bad) and 'nan' in message), message
    # the same from YAML / JSON: the full key
    with pytest.raises(ConfigError) as info:
        from_mapping(cls, {name: bad}, prefix=f'dynamic_callbacks.{section}')
    assert str(info.value).startswith(f'dynamic_callbacks.{section}.{name}'), str(info.value)


@pytest.mark.parametrize('section,name', FIELDS, ids=[f'{s}.{n}' for s, n in FIELDS])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_a_valid_value_round_trips_through_json(section, name, data):
    cls = CLASSES[section]
    value = data.draw(valid(check_of(cls, name)), label=name)
    if value is None:  # an optional setting off: nothing else needed
        settings_ = {**BASE.get(section, {}), name: None}
    else:
        settings_ = {**BASE.get(section, {}), **reading_selector(section, cls, name),
                     **companions(section, name, value), name: value}
    try:
        config = cls(**settings_)
    except ConfigError as e:  # only a rule between two settings may refuse a single valid value
        assert name in CROSS and str(e).split(':')[0] in CROSS, str(e)
        assume(False)
    assert getattr(config, name) == value or (isinstance(value, dict) and dict(getattr(config, name)) == value)
    raw = json.loads(json.dumps(to_mapping(config, changed_only=True)))  # what travels in the environment
    assert from_mapping(cls, raw, prefix=section) == config


def test_defaults_are_valid_and_round_trip():
    for section, cls in CLASSES.items():
        if section in ('batch_schedule', ):  # needs a table: no useful default
            with pytest.raises(ConfigError, match='schedule: give at least one'):
                cls()
            continue
        config = cls()
        assert from_mapping(cls, to_mapping(config, changed_only=True), prefix=section) == config
        assert to_mapping(config, changed_only=True) == {}


@pytest.mark.parametrize('value', [math.nan, math.inf, -math.inf, True])
def test_measured_nan_in_lr_schedule_warmup_is_refused(value):
    for key in ('warmup', 'hold'):
        with pytest.raises(ConfigError, match=rf'dynamic_callbacks.lr_schedule.{key}: expected optimizer steps'):
            parse_section({'lr_schedule': {key: value}}, ['lr_schedule'])


@pytest.mark.parametrize('value', [1, True, 'abc', None, 2.5])
def test_length_rules_of_the_wrong_shape_name_the_key(value):
    with pytest.raises(ConfigError) as info:
        parse_section({'length_batching': {'mode': 'rules', 'rules': value}}, ['length_batching'])
    assert str(info.value).startswith('dynamic_callbacks.length_batching.rules: '), str(info.value)
    assert 'not iterable' not in str(info.value)


def test_bool_is_not_a_choice_of_one():
    with pytest.raises(ConfigError, match="oom_recovery: must be one of 'auto', true, false, got 1"):
        IntegrationConfig(oom_recovery=1)
    assert IntegrationConfig(oom_recovery=True).oom_recovery is True


# ---- reads tables: every combination -----------------------------------------------------------------------

COMBINATIONS = [(section, row.selector, choice, name)
                for section, cls in CLASSES.items() for row in cls.reads for choice in row.by
                for name in sorted(row.governed)]


def test_every_class_with_a_policy_or_mode_has_a_reads_table():
    with_tables = {s for s, cls in CLASSES.items() if cls.reads}
    assert {'batch_growth', 'lr_schedule', 'memory_backoff', 'length_batching', 'checkpoint_rotation'} <= with_tables
    for section, cls in CLASSES.items():
        names = {f.name for f in dataclasses.fields(cls)}
        for row in cls.reads:
            assert row.selector in names and row.governed <= names and row.selector not in row.governed


@pytest.mark.parametrize('section,selector,choice,name', COMBINATIONS,
                         ids=[f'{s}.{n}@{sel}={c}' for s, sel, c, n in COMBINATIONS])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_setting_the_chosen_policy_does_not_read_is_refused(section, selector, choice, name, data):
    cls = CLASSES[section]
    row = next(r for r in cls.reads if r.selector == selector)
    value = representative(row, choice)
    default = default_of(cls, name)
    other = data.draw(valid(check_of(cls, name)).filter(lambda v: v is not None and v != default), label=name)
    settings_ = {selector: value, **COMPANIONS.get((section, selector, value), {}), name: other}
    reads = name in row.by[choice]
    if reads:
        try:
            cls(**settings_)
        except ConfigError as e:
            assert str(e).split(':')[0] in CROSS, str(e)
        else:
            from_mapping(cls, settings_, prefix=section)
        return
    with pytest.raises(ConfigError) as info:
        cls(**settings_)
    message = str(info.value)
    shown = 'true' if value is True else 'false' if value is False else 'null' if value is None else str(value)
    assert message.startswith(f'{name}: only read by {selector}: '), message
    assert f'the configured {selector} is {shown}' in message, message
    # written in YAML with its default value it is refused too (the user wrote it, nothing reads it)
    with pytest.raises(ConfigError, match=rf'dynamic_callbacks.{section}.{name}: only read by {selector}'):
        from_mapping(cls, {selector: value, **COMPANIONS.get((section, selector, value), {}), name: default},
                     prefix=f'dynamic_callbacks.{section}')


def default_of(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return field_check(f)(name, value)


def test_measured_table_with_interval_policy():
    with pytest.raises(ConfigError) as info:
        parse_section({'batch_growth': {'policy': 'interval', 'table': {0: 2, 10: 4}}}, ['batch_growth'])
    assert str(info.value) == ('dynamic_callbacks.batch_growth.table: only read by policy: table; the configured '
                               'policy is interval (remove table, or change policy)')


# ---- controls ------------------------------------------------------------------------------------------------


def test_declared_controls_are_protocol_controls():
    for section, cls in CALLBACK_CONFIGS.items():
        assert set(cls.controls) <= set(protocol.CONTROLS), section
        for control in cls.controls:
            assert set(protocol.CONTROLS[control][1]) <= set(protocol.REQUEST_FLAGS)


PAIRS = [(a, b) for i, a in enumerate(CALLBACK_CONFIGS) for b in list(CALLBACK_CONFIGS)[i + 1:]]


@pytest.mark.parametrize('first,second', PAIRS, ids=[f'{a}+{b}' for a, b in PAIRS])
def test_two_callbacks_driving_one_control_are_refused(first, second):
    shared = set(CALLBACK_CONFIGS[first].controls) & set(CALLBACK_CONFIGS[second].controls)
    if not shared:
        check_controls([first, second])
        return
    with pytest.raises(ConfigError) as info:
        check_controls([first, second])
    message = str(info.value)
    assert message.startswith(f'callbacks: {first} and {second} both request ')
    for control in shared:
        assert protocol.CONTROLS[control][0] in message


def test_the_pairs_that_conflict_are_the_honest_ones():
    conflicting = {frozenset((a, b)) for a, b in PAIRS
                   if set(CALLBACK_CONFIGS[a].controls) & set(CALLBACK_CONFIGS[b].controls)}
    # batch_schedule and batch_growth both set the batch size (and pieces): the last request would win. Everything
    # else composes: length_batching cuts micro-batches of at most the batch size growth sets; memory_backoff's pass
    # limit overrides num_pieces by design; lr_schedule shapes the LR that batch_growth's lr_scale multiplies.
    assert conflicting == {frozenset(('batch_schedule', 'batch_growth'))}


def test_measured_schedule_and_growth_listed_together():
    with pytest.raises(ConfigError) as info:
        parse_section({'batch_schedule': {'schedule': {0: 2}}, 'batch_growth': {}}, ['batch_schedule', 'batch_growth'])
    message = str(info.value)
    assert 'batch_schedule and batch_growth both request the per-device batch size (control.new_batch_size' in message
    assert 'batch_growth with policy: table' in message
    with pytest.raises(ConfigError, match='batch_growth is listed twice'):
        parse_section({}, ['batch_growth', 'batch_growth'])


def test_controls_are_claimed_at_train_begin_on_a_hand_built_trainer():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from swift_dynamic_callbacks.callbacks import BatchGrowthCallback, BatchScheduleCallback, LRScheduleCallback
    from swift_dynamic_callbacks.config.batch_schedule import BatchScheduleConfig
    args = TrainingArguments(output_dir='unused', report_to=[])
    growth, lr = BatchGrowthCallback(), LRScheduleCallback()
    schedule = BatchScheduleCallback(BatchScheduleConfig(schedule={0: 2}))
    assert growth.controls == ('batch_size', 'num_pieces', 'lr_scale', 'optimizer_scale')
    assert schedule.controls == ('batch_size', 'num_pieces')
    state, control = TrainerState(max_steps=10), TrainerControl()
    growth.on_train_begin(args, state, control)
    lr.on_train_begin(args, state, control)  # a different control: fine
    growth.on_train_begin(args, state, control)  # the same callback again: fine
    with pytest.raises(ConfigError, match='callbacks: batch_growth and batch_schedule both request the per-device '
                       'batch size'):
        schedule.on_train_begin(args, state, control)
    schedule.on_train_begin(args, TrainerState(max_steps=10), TrainerControl())  # a new run starts with no claims


def test_memory_backoff_cpu_probe_needs_its_budget_at_config_time():
    with pytest.raises(ConfigError, match='cpu_budget_gib: probe: cpu'):
        MemoryBackoffConfig(probe='cpu')
    with pytest.raises(ConfigError) as info:
        MemoryBackoffConfig(probe='cuda', cpu_budget_gib=4)
    assert str(info.value).startswith('cpu_budget_gib: only read by probe: auto | cpu; the configured probe is cuda')


def test_batch_growth_function_is_checked_at_config_time():
    assert BatchGrowthConfig(policy='callable', function=FUNCTION).resolved_function() is grow
    with pytest.raises(ConfigError, match=r"function: cannot import 'no_such_module_xyz:fn'"):
        BatchGrowthConfig(policy='callable', function='no_such_module_xyz:fn')
    with pytest.raises(ConfigError, match=rf"function: cannot import '{__name__}:nope'"):
        BatchGrowthConfig(policy='callable', function=f'{__name__}:nope')
    assert 'torch' in sys.modules  # here the full check runs; see test_cli_check for the torch-free process
