"""Unit tests of the OOM messages, note and record (integrations/oom_report.py: pure builders, no trainer)."""

from __future__ import annotations

from swift_dynamic_callbacks.integrations.loss_kind import LossKind
from swift_dynamic_callbacks.integrations.oom_report import PassOom, recovered, too_large_message, \
    unrecovered_message, unrecovered_note

MEMORY = {'total_gib': 80.0, 'free_gib': 1.5}
SUM = LossKind('token_sum', None, '')


def _oom(**kw) -> PassOom:
    facts = dict(rank=1, step=6, pass_size=8, pass_tokens=4096, unit='tokens', fitted=2048, memory=MEMORY)
    return PassOom(**{**facts, **kw})


def test_recovered_under_pass_tokens_caps_tokens_not_rows():
    event, record = recovered(_oom(), new_cap=2048, retries=1, single_sample_retries=0, oom_count=3, loss=SUM)
    assert (event.pass_size, event.new_cap, event.new_tokens, event.pass_tokens) == (8, None, 2048, 4096)
    assert event.retries == 1 and event.memory == MEMORY
    v = record.values
    assert (record.kind, record.reason, record.step) == ('oom', 'recovered', 7)  # the step it ran in
    assert (v['new_pass_cap'], v['new_pass_tokens'], v['fitted'], v['oom_count'], v['rank']) == (None, 2048, 2048,
                                                                                              3, 1)
    assert v['memory_free_gib'] == 1.5 and v['loss'] == 'token_sum'
    assert 'passes of at most 2048 tokens' in record.message and record.message.endswith('same gradient)')


def test_recovered_in_rows_and_the_passes_that_cannot_be_cut():
    rows = _oom(unit='samples', fitted=4)
    event, record = recovered(rows, new_cap=4, retries=2, single_sample_retries=0, oom_count=1, loss=SUM)
    assert (event.new_cap, event.new_tokens) == (4, None) and record.values['new_pass_cap'] == 4
    assert 'at most 4 rows a pass for the rest of the step' in record.message
    _, one = recovered(_oom(unit='samples', pass_size=1), new_cap=None, retries=1, single_sample_retries=1,
                       oom_count=1, loss=SUM)
    assert 'one row cannot be cut' in one.message and one.values['single_sample_retries'] == 1
    _, outside = recovered(_oom(pass_size=0, pass_tokens=None), new_cap=None, retries=1, single_sample_retries=1,
                           oom_count=1, loss=SUM)
    assert 'outside a pass' in outside.message and outside.values['pass_tokens'] is None


def test_recovered_under_a_mean_loss_says_how_pieces_are_weighted():
    smoothing = LossKind('token_mean', 'label_smoothing_factor: 0.1', 'a mean over label tokens', shift=True)
    _, record = recovered(_oom(), new_cap=2048, retries=1, single_sample_retries=0, oom_count=1, loss=smoothing)
    assert 'weighted by its share of the tokens, label_smoothing_factor: 0.1' in record.message
    assert record.values['loss'] == 'token_mean'


def test_unrecovered_names_the_pass_the_budget_the_setting_and_the_resume_budget():
    message = unrecovered_message(_oom(), engine='zero3', why_off='zero3: a pass holds collectives', budget=None,
                                  ceiling=6000, resume=2048)
    for part in ('rank 1', '8 rows (4096 tokens)', 'at step 7', 'under zero3', '(zero3: a pass holds collectives)',
                 'the pass budget was 6000 tokens (pass_tokens 6000)', 'Lower length_batching.pass_tokens',
                 'within 2048 tokens', 'dynamic_oom.rank1.json'):
        assert part in message, part
    rows = unrecovered_message(_oom(unit='samples', pass_size=6), engine='fsdp2', why_off='x', budget=6, ceiling=None,
                               resume=3)
    assert 'Lower per_device_train_batch_size' in rows and 'within 3 samples' in rows and 'was 6 samples' in rows
    note = unrecovered_note(_oom(pass_tokens=None), engine='zero2', error=RuntimeError('CUDA out of memory' * 50),
                            time=1.5e9)
    assert note['pass_tokens'] == 0 and note['engine'] == 'zero2' and len(note['error']) == 300
    assert (note['step'], note['rank'], note['unit'], note['fitted'], note['time']) == (6, 1, 'tokens', 2048, 1.5e9)


def test_too_large_names_the_sample_and_never_skips_it():
    message = too_large_message(sample=17, tokens=900, padded=1024, halvings=3, retries=2, setting_retries=2,
                                memory=MEMORY)
    for part in ('dataset index 17', '900 tokens, padded to 1024', '3 halvings', '2 retries',
                 'oom_single_sample_retries: 2', 'It was not skipped'):
        assert part in message, part


def test_the_note_of_an_unrecovered_oom_is_read_back_by_the_resumed_run(tmp_path, caplog):
    """The notes of the ranks that ran out of memory after the resumed checkpoint's step become ``oom`` records
    (reason ``unrecovered``); one from before that step is not this run's; one that cannot be read is said."""
    import logging

    from swift_dynamic_callbacks.integrations.pass_budget import oom_notes, write_oom_note
    write_oom_note(str(tmp_path), unrecovered_note(_oom(), engine='zero3', error=RuntimeError('oom'), time=1.0))
    write_oom_note(str(tmp_path), unrecovered_note(_oom(rank=0, step=2), engine='zero3', error=RuntimeError('x'),
                                                   time=1.0))
    (tmp_path / 'dynamic_oom.rank2.json').write_text('{"step": 6, "ra', encoding='utf-8')  # ended while writing
    with caplog.at_level(logging.WARNING, logger='swift_dynamic_callbacks'):
        [record] = oom_notes(str(tmp_path), after_step=4)
    assert (record.kind, record.reason, record.step) == ('oom', 'unrecovered', 7)
    assert record.values['rank'] == 1 and record.values['pass_tokens'] == 4096 and record.values['engine'] == 'zero3'
    assert 'dynamic_oom.rank2.json cannot be read' in caplog.text


def test_an_unrecovered_one_row_pass_is_not_promised_a_lower_budget():
    message = unrecovered_message(_oom(pass_size=1), engine='fsdp2', why_off='x', budget=None, ceiling=6000,
                                  resume=None)
    assert 'One row cannot be cut' in message and 'lower max_length' in message and 'within' not in message


def test_the_budget_a_message_promises_is_the_one_the_resumed_run_folds_to(tmp_path):
    """``resume_budget`` is the fold's policy: half the failing pass, or the largest pass that ran clean below it."""
    from swift_dynamic_callbacks.integrations.pass_budget import PassBudget, oom_notes, write_oom_note
    budget = PassBudget()
    budget.configure(tokens_ceiling=6000, rows=8)
    budget.start_step(None)
    assert budget.resume_budget(8, 4096) == 2048 and budget.resume_budget(1, 4096) is None
    budget.ran(4, 1500)  # a pass that ran clean in the step: the resumed run plans at it
    assert budget.resume_budget(8, 4096) == 1500
    rows = PassBudget()
    rows.configure(tokens_ceiling=None, rows=6)
    rows.start_step(None)
    assert rows.resume_budget(6, 900) == 3
    note = unrecovered_note(_oom(pass_size=8, pass_tokens=4096, fitted=1500), engine='zero3', error=RuntimeError('x'),
                            time=1.0)
    write_oom_note(str(tmp_path), note)
    resumed = PassBudget()  # the resumed run folds the note before its first step
    resumed.configure(tokens_ceiling=6000, rows=8)
    resumed.fold(oom_notes(str(tmp_path), after_step=0), 6, again=True)
    assert resumed.budget == budget.resume_budget(8, 4096) == 1500


def test_unrecovered_where_micro_batches_cannot_be_cut_advises_the_layout_not_a_resume_budget():
    """A loss the pack cannot split (or pairs, or packed rows): a resumed run plans at the same micro-batches, so the
    message promises no smaller passes; it names why and the GA that keeps the global batch in smaller micro-batches."""
    message = unrecovered_message(_oom(unit='samples', pass_size=3), engine='single', why_off='loss_type: x',
                                  budget=None, ceiling=3, resume=1, cannot_split='under loss_type: x: a mean per call',
                                  accumulation=2)
    assert 'cannot cut a micro-batch into smaller passes (under loss_type: x: a mean per call)' in message
    assert 'gradient_accumulation_steps: 6 (now 2)' in message and 'plans its passes within' not in message
    one_row = unrecovered_message(_oom(unit='samples', pass_size=1), engine='single', why_off='x', budget=None,
                                  ceiling=1, resume=None, cannot_split='why')
    assert 'One row cannot be cut' in one_row
