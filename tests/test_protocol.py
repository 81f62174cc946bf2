"""The control-flag protocol: request helpers, reading pending requests, decisions, metrics, the watchdog."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import TrainerControl

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.protocol import BatchRequest
from swift_dynamic_callbacks.protocol import requests as protocol_requests
from swift_dynamic_callbacks.records import DecisionRecord

DATASET = list(range(10))


@pytest.fixture
def control():
    return TrainerControl()


@pytest.fixture
def fresh_watchdog(monkeypatch):
    monkeypatch.setattr(protocol_requests, '_warned_unhonoured', False)  # restored after the test


# ---- request helpers -------------------------------------------------------------------------------------


@pytest.mark.parametrize('bad', [0, -1, True, False, 2.5, '3', None])
def test_request_batch_size_rejects(control, bad):
    with pytest.raises(ValueError, match='new_batch_size') as info:
        protocol.request_batch_size(control, bad)
    assert repr(bad) in str(info.value)
    assert getattr(control, 'new_batch_size', None) is None  # nothing was set


@pytest.mark.parametrize('bad', [0, -1, True, 2.5])
def test_request_num_pieces_rejects(control, bad):
    with pytest.raises(ValueError, match='new_num_pieces') as info:
        protocol.request_num_pieces(control, bad)
    assert repr(bad) in str(info.value)
    assert getattr(control, 'new_num_pieces', None) is None


def test_request_helpers_set_flags(control):
    protocol.request_batch_size(control, 4)
    protocol.request_num_pieces(control, 2)
    assert control.new_batch_size == 4
    assert control.new_num_pieces == 2
    assert protocol.has_pending_request(control)
    assert protocol.pending_request(control) == BatchRequest(batch_size=4, num_pieces=2, via_dataloader=False)


def test_last_request_wins(control):
    protocol.request_batch_size(control, 4)
    protocol.request_batch_size(control, 6)
    assert protocol.pending_request(control).batch_size == 6


def test_no_request(control):
    assert not protocol.has_pending_request(control)
    request = protocol.pending_request(control)
    assert request == BatchRequest()
    assert request.empty
    assert not BatchRequest(num_pieces=2).empty
    assert not BatchRequest(batch_size=1).empty


# ---- pending_request -------------------------------------------------------------------------------------


def test_seed_form_reads_loader_batch_size(control):
    control.should_update_dataloader = True
    control.new_dataloader = DataLoader(DATASET, batch_size=3)
    assert protocol.has_pending_request(control)
    request = protocol.pending_request(control)
    assert request == BatchRequest(batch_size=3, num_pieces=None, via_dataloader=True)
    # reading does not clear
    assert control.should_update_dataloader is True
    assert protocol.pending_request(control).batch_size == 3


def test_request_dataloader_helper(control):
    loader = DataLoader(DATASET, batch_size=5)
    protocol.request_dataloader(control, loader)
    assert control.should_update_dataloader is True
    assert control.new_dataloader is loader
    assert protocol.pending_request(control) == BatchRequest(batch_size=5, via_dataloader=True)


def test_seed_form_with_agreeing_new_batch_size(control):
    protocol.request_dataloader(control, DataLoader(DATASET, batch_size=3))
    protocol.request_batch_size(control, 3)
    assert protocol.pending_request(control).batch_size == 3


def test_seed_form_conflicting_new_batch_size(control):
    protocol.request_dataloader(control, DataLoader(DATASET, batch_size=3))
    protocol.request_batch_size(control, 5)
    with pytest.raises(ValueError, match='conflicting') as info:
        protocol.pending_request(control)
    message = str(info.value)
    assert 'new_batch_size=5' in message
    assert 'batch_size=3' in message


def test_new_dataloader_without_should_update(control):
    control.new_dataloader = DataLoader(DATASET, batch_size=3)
    assert protocol.has_pending_request(control)
    with pytest.raises(ValueError, match='should_update_dataloader is not True'):
        protocol.pending_request(control)


def test_should_update_without_loader(control):
    control.should_update_dataloader = True
    assert protocol.has_pending_request(control)
    with pytest.raises(ValueError, match='new_dataloader is None'):
        protocol.pending_request(control)


def test_seed_form_loader_without_batch_size(control):
    sampler = torch.utils.data.BatchSampler(range(10), batch_size=4, drop_last=False)
    loader = DataLoader(DATASET, batch_sampler=sampler)
    protocol.request_dataloader(control, loader)
    # batch size is read from the batch sampler when the loader has none
    assert protocol.pending_request(control).batch_size == 4
    control.should_update_dataloader = True  # set by hand, bypassing the helper's own check
    control.new_dataloader = DataLoader(DATASET, batch_size=None)
    with pytest.raises(ValueError, match='cannot read a batch size'):
        protocol.pending_request(control)


def test_pending_request_validates_raw_setattr(control):
    control.new_batch_size = 0
    with pytest.raises(ValueError, match='new_batch_size'):
        protocol.pending_request(control)
    control.new_batch_size = 2
    control.new_num_pieces = True
    with pytest.raises(ValueError, match='new_num_pieces'):
        protocol.pending_request(control)


def test_request_dataloader_validates_at_call_site(control):
    with pytest.raises(ValueError, match='cannot read a batch size'):
        protocol.request_dataloader(control, DataLoader(DATASET, batch_size=None))
    assert not protocol.has_pending_request(control)


# ---- clear_requests --------------------------------------------------------------------------------------


def test_clear_requests(control):
    protocol.request_dataloader(control, DataLoader(DATASET, batch_size=3))
    protocol.request_batch_size(control, 3)
    protocol.request_num_pieces(control, 2)
    protocol.record_decision(control, DecisionRecord('x', 'batch_size', 'test'))
    protocol.publish_metrics(control, {'a': 1})
    assert protocol.has_pending_request(control)
    protocol.clear_requests(control)
    assert control.should_update_dataloader is False
    assert control.new_dataloader is None
    assert control.new_batch_size is None
    assert control.new_num_pieces is None
    assert not protocol.has_pending_request(control)
    assert protocol.pending_request(control).empty
    # decisions and metrics are not request flags: untouched
    assert len(control.dynamic_decisions) == 1
    assert protocol.current_metrics(control) == {'a': 1.0}


# ---- decisions and metrics -------------------------------------------------------------------------------


def test_record_and_drain_decisions(control):
    assert protocol.drain_decisions(control) == []
    first = DecisionRecord('batch_schedule', 'batch_size', 'schedule', {'old': 2, 'new': 4}, step=3)
    second = DecisionRecord('batch_schedule', 'num_pieces', 'schedule', {'old': 1, 'new': 2}, step=3)
    protocol.record_decision(control, first)
    protocol.record_decision(control, second)
    drained = protocol.drain_decisions(control)
    assert drained == [first, second]
    assert drained[0] is first
    assert control.dynamic_decisions == []
    assert protocol.drain_decisions(control) == []
    # the drained list is a copy: appending afterwards does not change it
    protocol.record_decision(control, first)
    assert drained == [first, second]
    assert protocol.drain_decisions(control) == [first]


def test_publish_and_current_metrics(control):
    assert protocol.current_metrics(control) == {}
    protocol.publish_metrics(control, {'dynamic/a': 1, 'dynamic/b': 2.5})
    protocol.publish_metrics(control, {'dynamic/a': 3})  # per-key overwrite, others kept
    metrics = protocol.current_metrics(control)
    assert metrics == {'dynamic/a': 3.0, 'dynamic/b': 2.5}
    assert all(type(v) is float for v in metrics.values())
    metrics['dynamic/a'] = 99  # a copy
    assert protocol.current_metrics(control)['dynamic/a'] == 3.0
    with pytest.raises((TypeError, ValueError)):
        protocol.publish_metrics(control, {'dynamic/c': 'not a number'})


# ---- watchdog --------------------------------------------------------------------------------------------


def test_warn_if_unhonoured_warns_once(control, fresh_watchdog):
    assert protocol.warn_if_unhonoured(control, 'nothing pending') is False
    protocol.request_batch_size(control, 4)
    with pytest.warns(RuntimeWarning, match='not honoured') as record:
        assert protocol.warn_if_unhonoured(control, 'cb, step 2') is True
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert 'cb, step 2' in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a second warning would raise
        assert protocol.warn_if_unhonoured(control, 'cb, step 3') is True
    assert protocol_requests._warned_unhonoured is True


def test_warn_if_unhonoured_silent_with_integration(control, fresh_watchdog):
    protocol.request_batch_size(control, 4)
    control._sdc_integration = True
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert protocol.warn_if_unhonoured(control, 'with integration') is False
    assert protocol_requests._warned_unhonoured is False
    # the watchdog is still armed for a control without integration
    other = TrainerControl()
    protocol.request_num_pieces(other, 2)
    with pytest.warns(RuntimeWarning):
        assert protocol.warn_if_unhonoured(other, 'no integration') is True


def test_warn_if_unhonoured_seed_form(control, fresh_watchdog):
    protocol.request_dataloader(control, DataLoader(DATASET, batch_size=2))
    with pytest.warns(RuntimeWarning):
        assert protocol.warn_if_unhonoured(control, 'seed') is True


SAMPLES = {'batch_size': 4, 'batch_plan': {'mode': 'balanced', 'pass_tokens': 2048}, 'num_pieces': 2,
           'pass_limit': {'samples': 3}, 'lr_schedule': {'warmup': 1, 'hold': 0, 'min_ratio': 0.1}, 'lr_scale': 1.5,
           'optimizer_scale': {'weight_decay': 0.5}}


def test_every_request_kind_is_one_declaration_the_rest_derives_from():
    """protocol.REQUESTS is the one declaration of a request kind: the request's fields, the flags, the controls, the
    JSON round trip (replay), the merge, the records that go with it and the applier all follow from it."""
    import dataclasses

    from swift_dynamic_callbacks.integrations.apply import FIELDS, RequestApplier
    from swift_dynamic_callbacks.integrations.requests import request_from_json, request_to_json
    from swift_dynamic_callbacks.records import DecisionRecord
    fields = [kind.field for kind in protocol.REQUESTS]
    assert sorted(SAMPLES) == sorted(fields)  # a new kind needs a sample here: the test names it
    assert [f.name for f in dataclasses.fields(BatchRequest)] == fields + ['via_dataloader']
    assert set(protocol.CONTROLS) == set(fields)
    assert {kind.flag for kind in protocol.REQUESTS} <= set(protocol.REQUEST_FLAGS)
    assert set(FIELDS) == {kind.applier for kind in protocol.REQUESTS}
    assert all(callable(getattr(RequestApplier, f'_{name}', None)) for name in FIELDS)
    for kind in protocol.REQUESTS:
        control = TrainerControl()
        protocol.request(control, kind.field, SAMPLES[kind.field])
        request = protocol.pending_request(control)
        assert not request.empty and protocol.has_pending_request(control)
        assert request_from_json(request_to_json(request)) == request  # what replay reads back
        assert protocol.merge_requests([request, request]) == request
        protocol.clear_requests(control)
        assert not protocol.has_pending_request(control) and protocol.pending_request(control).empty
        with pytest.raises(ValueError, match=f'control.{kind.flag}'):
            protocol.request(control, kind.field, object())
        assert protocol.is_request_record(DecisionRecord('cb', kind.records[0], 'test', {}))
    assert not protocol.is_request_record(DecisionRecord('integration', 'oom', 'recovered', {}))


def test_the_flag_table_in_the_docs_names_every_flag():
    """docs/control-flags.md is the one reference for the flags: its table has a row for each, and only for them."""
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs', 'control-flags.md')
    with open(path, encoding='utf-8') as f:
        rows = [line for line in f if line.startswith('| `')]
    named = {flag for row in rows for flag in re.findall(r'`(\w+)`', row.split('|')[1])}
    assert named == set(protocol.ALL_FLAGS)
