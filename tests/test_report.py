"""The report command: reading and aligning ms-swift logs, the markdown summary, the PNG, the CLI's errors."""

from __future__ import annotations

import json
import os

import pytest

from swift_dynamic_callbacks import cli
from swift_dynamic_callbacks.report import (REPORT_MD, REPORT_PNG, ReportError, RunData, build_markdown, decision_label,
                                            load_run, memory_keys, panels, parse_logging_lines, parse_number, series,
                                            write_report)

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _log_line(step: int, max_steps: int, **values) -> dict:
    return {**values, 'epoch': step / max_steps, 'global_step/max_steps': f'{step}/{max_steps}',
            'elapsed_time': f'{step}s', 'remaining_time': '0s', 'train_speed(s/it)': 0.5}


DECISIONS = [
    {'source': 'batch_growth', 'kind': 'batch_size', 'reason': 'start', 'values': {'old': None, 'new': 1},
     'message': 'global batch - -> 1', 'step': 0},
    {'source': 'batch_growth', 'kind': 'batch_size', 'reason': 'interval', 'values': {'old': 1, 'new': 2},
     'message': 'global batch 1 -> 2 | lr x1.414', 'step': 2},
    {'source': 'integration', 'kind': 'max_steps', 'reason': 'batch_size', 'values': {'old': 8, 'new': 5},
     'message': '', 'step': 2},
    {'source': 'lr_plateau', 'kind': 'lr_scale', 'reason': 'plateau', 'values': {'new': 0.5, 'pending': True},
     'message': 'restart', 'step': 4},
]


def write_run(root, *, memory: bool = True, decisions: bool = True, finished: bool = True) -> str:
    """A synthetic ms-swift output dir: 4 training lines (strings included), an eval line, runtime, summary."""
    out = root / 'run'
    out.mkdir()
    lines = []
    for step, (batch, loss) in enumerate([(1, 3.0), (1, 2.5), (2, 2.0), (2, 1.5)], start=1):
        values = {'loss': loss, 'grad_norm': 1.0, 'learning_rate': 1e-3 * batch, 'dynamic/batch_size': batch,
                  'dynamic/global_batch_size': 2 * batch, 'token_acc': '10.0%'}
        if memory:
            values['dynamic/memory_peak_gib'] = 0.5 + step / 10
            values['memory(GiB)'] = 1.25
        lines.append(_log_line(step, 4, **values))
        if step == 2:
            lines.append(_log_line(step, 4, eval_loss=2.75, eval_runtime=0.1))
    if finished:
        lines.append(_log_line(4, 4, train_runtime=12.5, train_loss=2.25))
    text = '\n'.join(json.dumps(line) for line in lines) + '\n'
    if finished:
        text += json.dumps({'global_step': 4, 'log_history': [], 'memory': 0}) + '\n'
    else:
        text += '{"loss": 1.2, "grad_n'  # a line cut by a crash
    (out / 'logging.jsonl').write_text(text)
    if decisions:
        (out / 'dynamic_decisions.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in DECISIONS))
    return str(out)


def test_parse_number_handles_swift_strings():
    assert parse_number(3) == 3.0 and parse_number('10.0%') == 10.0 and parse_number(' 2.5e-3 ') == 0.0025
    assert parse_number('1/20') is None and parse_number('35s') is None and parse_number(True) is None
    assert parse_number(float('nan')) is None and parse_number(None) is None


def test_rows_steps_and_series(tmp_path):
    run = load_run(write_run(tmp_path))
    assert run.summary is not None and run.skipped_lines == 0
    assert [r['step'] for r in run.rows] == [1, 2, 2, 3, 4, 4]  # the eval and runtime lines share their step
    assert all(isinstance(v, float) for r in run.rows for k, v in r.items() if k != 'step')
    assert 'elapsed_time' not in run.rows[0] and run.rows[0]['token_acc'] == 10.0
    assert series(run.rows, 'dynamic/batch_size') == ([1, 2, 3, 4], [1.0, 1.0, 2.0, 2.0])
    assert series(run.rows, 'eval_loss') == ([2], [2.75])
    assert memory_keys(run.rows) == ['dynamic/memory_peak_gib', 'memory(GiB)']
    assert [title for title, _ in panels(run.rows)] == ['batch size', 'learning rate', 'loss', 'memory (GiB)']
    assert dict(panels(run.rows))['loss'] == ['loss', 'eval_loss']


def test_a_line_without_step_takes_the_previous_one_and_a_cut_line_is_skipped():
    rows, summary, skipped = parse_logging_lines(['{"loss": 1.0, "global_step/max_steps": "3/9"}', '{"x": 2}',
                                                  '{"loss": 0.5, "step": 5}', '{"cut', '', '[1, 2]'])
    assert [r['step'] for r in rows] == [3, 3, 5] and summary is None and skipped == 2


def test_panels_without_data_are_left_out(tmp_path):
    run = load_run(write_run(tmp_path, memory=False))
    assert [title for title, _ in panels(run.rows)] == ['batch size', 'learning rate', 'loss']
    plain = [{'step': 1, 'loss': 2.0, 'learning_rate': 1e-3}]
    assert [title for title, _ in panels(plain)] == ['learning rate', 'loss']


def test_markdown_lists_every_decision(tmp_path):
    run = load_run(write_run(tmp_path))
    md = build_markdown(run)
    assert md.startswith('# Dynamic training report: run')
    assert '- Run: 4 optimizer steps, 1 epochs, 12.5 s' in md
    assert '- Final loss: 1.5 (step 4; first 3)' in md and '- Final eval_loss: 2.75 (step 2)' in md
    assert '- Per-device batch size: 1 -> 2' in md
    assert '- Decisions: 4 (batch_growth 2, integration 1, lr_plateau 1)' in md
    table = md.split('## Decisions', 1)[1]
    rows = [line for line in table.splitlines() if line.startswith('| ') and not line.startswith('| step')]
    assert len(rows) == len(DECISIONS)
    assert rows[0] == '| 0 | batch_growth | batch_size | start | global batch - -> 1 |'
    assert rows[1] == '| 2 | batch_growth | batch_size | interval | global batch 1 -> 2 \\| lr x1.414 |'
    assert rows[2] == '| 2 | integration | max_steps | batch_size | old=8, new=5 |'  # no message: the values
    assert rows[3] == '| 4 | lr_plateau | lr_scale | plateau (pending) | restart |'
    assert f'![training curves and decisions]({REPORT_PNG})' in md


def test_markdown_of_an_unfinished_run_without_decisions(tmp_path):
    run = load_run(write_run(tmp_path, decisions=False, finished=False))
    md = build_markdown(run, png_name=None)
    assert run.skipped_lines == 1 and 'the run did not finish' in md and '1 unreadable line(s)' in md
    assert 'No decision records' in md and '![' not in md


def test_decision_labels():
    assert [decision_label(d) for d in DECISIONS] == ['batch_size ->1', 'batch_size 1->2', 'max_steps 8->5',
                                                      'lr_scale ->0.5']
    assert decision_label({'kind': 'stop', 'values': {'epochs': 1.0}}) == 'stop'


def test_write_report_writes_a_png_and_the_markdown(tmp_path):
    png, md = write_report(write_run(tmp_path), tmp_path / 'report')
    assert png == str(tmp_path / 'report' / REPORT_PNG) and md == str(tmp_path / 'report' / REPORT_MD)
    with open(png, 'rb') as f:
        head = f.read(8)
    assert head == PNG_MAGIC and os.path.getsize(png) > 10_000
    assert open(md, encoding='utf-8').read().count('| batch_growth |') == 2


def test_an_empty_log_still_gives_a_figure(tmp_path):
    out = tmp_path / 'empty'
    out.mkdir()
    (out / 'logging.jsonl').write_text('')
    png, md = write_report(str(out))
    assert os.path.getsize(png) > 0 and '- Run: 0 optimizer steps' in open(md).read()
    assert RunData(str(out)).rows == []


def test_cli_report_and_its_errors(tmp_path, capsys):
    run = write_run(tmp_path)
    assert cli.main(['report', run]) == 0
    assert os.path.getsize(os.path.join(run, REPORT_PNG)) > 0 and os.path.isfile(os.path.join(run, REPORT_MD))
    assert REPORT_MD in capsys.readouterr().out
    assert cli.main(['report', str(tmp_path / 'missing')]) == 2
    assert 'no such directory' in capsys.readouterr().err
    (tmp_path / 'no-log').mkdir()
    assert cli.main(['report', str(tmp_path / 'no-log')]) == 2
    assert 'no logging.jsonl' in capsys.readouterr().err
    with pytest.raises(ReportError, match='no logging.jsonl'):
        load_run(tmp_path / 'no-log')


def test_spread_labels_keeps_a_label_width_between_labels():
    from swift_dynamic_callbacks.report import spread_labels
    assert spread_labels([], 8) == []
    assert spread_labels([10, 10, 10, 50], 8) == [10, 18, 26, 50]
    assert spread_labels([30, 10, 12], 8) == [30, 10, 18]  # order along the axis, returned in input order
    assert spread_labels([0, 4, 20], 8) == [0, 8, 20]


def test_labels_of_decisions_at_the_same_step_do_not_overlap(tmp_path):
    """Five decisions at step 0 and three at step 3 (what a start and a growth write): every label's box on the
    rendered figure is apart from every other's."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Annotation
    from swift_dynamic_callbacks.report import draw_report, load_run
    out = write_run(tmp_path)
    crowd = [{'source': s, 'kind': k, 'reason': 'start', 'values': {'old': None, 'new': 1}, 'step': 0}
             for s, k in [('batch_growth', 'batch_size'), ('lr_schedule', 'lr_schedule'), ('integration', 'engine'),
                          ('integration', 'max_steps'), ('training_log', 'memory')]]
    crowd += [{'source': s, 'kind': k, 'reason': 'interval', 'values': {'old': 1, 'new': 2}, 'step': 3}
              for s, k in [('batch_growth', 'batch_size'), ('integration', 'max_steps'), ('lr_schedule', 'lr_scale')]]
    with open(os.path.join(out, 'dynamic_decisions.jsonl'), 'a', encoding='utf-8') as f:
        for d in crowd:
            f.write(json.dumps(d) + '\n')
    run = load_run(out)
    fig = draw_report(run)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [a.get_window_extent(renderer) for a in fig.axes[0].texts if isinstance(a, Annotation)]
        assert len(boxes) == len([d for d in run.decisions if isinstance(d.get('step'), int)]) >= 8
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)
        legend = fig.axes[0].get_legend().get_window_extent(renderer)
        assert not any(box.overlaps(legend) for box in boxes)  # the top panel's legend is out of the labels' way
    finally:
        plt.close(fig)


def test_a_sparse_series_is_drawn_as_points_not_a_trend(tmp_path):
    """An evaluation at the start and at the end of a run (or any series with a gap over a tenth of the run) is
    drawn as markers: a line between two measurements would read as a measured trend (at 03097fd it was a line)."""
    from swift_dynamic_callbacks.report import RunData, draw_report, load_run, sparse
    assert sparse([0, 100], 100) and sparse([5], 100) and sparse([0, 10, 60], 100)
    assert not sparse([10, 20, 30], 100) and not sparse(list(range(1, 101)), 100)
    run = load_run(write_run(tmp_path))
    rows = [dict(r) for r in run.rows] + [{'step': 1, 'eval_loss': 3.0}]
    fig = draw_report(RunData(run.output_dir, rows, run.summary, run.decisions))
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    assert lines['eval_loss'].get_linestyle() == 'None' and lines['eval_loss'].get_marker() == 'o'
    assert lines['loss'].get_linestyle() == '-'
