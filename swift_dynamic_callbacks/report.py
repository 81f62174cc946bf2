"""``swift-dynamic report``: a PNG and a markdown summary of what a run did, from its output directory.

Inputs (all written by a normal ms-swift run with the pack):

- ``logging.jsonl``: one JSON object per log event (ms-swift's progress callback). Some values are strings
  (``'global_step/max_steps': '1/20'``, ``'elapsed_time': '1s'``); the optimizer step is read from
  ``global_step/max_steps`` (or ``step``); the last line is the run summary (it has ``log_history``).
- ``dynamic_decisions.jsonl``: the decision records (:func:`~swift_dynamic_callbacks.records.read_decisions`).
- memory values, when logged: ms-swift's ``memory(GiB)`` (CUDA runs) and ``dynamic/memory_*`` (the
  ``training_log`` callback).

Outputs: ``dynamic_report.png`` (stacked panels vs optimizer step: batch size, learning rate, loss, memory; a
panel without data is left out; every decision is a dashed vertical line coloured by the callback that made it)
and ``dynamic_report.md`` (run length, final loss, one table row per decision).

Reading, aligning and the markdown are pure functions (:func:`read_logging`, :func:`series`,
:func:`build_markdown`); only :func:`plot_report` imports matplotlib (Agg backend).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .records import DECISIONS_FILE, read_decisions

LOGGING_FILE = 'logging.jsonl'
REPORT_PNG = 'dynamic_report.png'
REPORT_MD = 'dynamic_report.md'

#: Panels of the figure: (title, y label, keys plotted in it). Memory keys are found in the data.
BATCH_KEYS = ('dynamic/batch_size', 'dynamic/global_batch_size')
LR_KEYS = ('learning_rate',)
LOSS_KEYS = ('loss', 'eval_loss')
MEMORY_PREFIX = 'dynamic/memory_'
SWIFT_MEMORY_KEY = 'memory(GiB)'

_NUMBER = re.compile(r'^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(%?)\s*$')


class ReportError(RuntimeError):
    """The output directory cannot be reported on (missing directory or ``logging.jsonl``)."""


@dataclass
class RunData:
    """What the report is built from.

    Attributes:
        output_dir: the run's output directory.
        rows: the log events in order, each with an int ``step`` (optimizer step) and the numeric values only.
        summary: the final summary line of ``logging.jsonl`` (``None`` when the run did not finish).
        decisions: the decision records, in file order.
        skipped_lines: lines of ``logging.jsonl`` that were not valid JSON (e.g. a line cut by a crash).
    """

    output_dir: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0


def parse_number(value: Any) -> float | None:
    """A log value as a float: numbers as they are, ``'10.0%'`` -> 10.0, ``'3.5'`` -> 3.5; anything else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        match = _NUMBER.match(value)
        if match:
            return float(match.group(1))
    return None


def _step_of(line: Mapping[str, Any]) -> int | None:
    progress = line.get('global_step/max_steps')
    if isinstance(progress, str) and '/' in progress:
        head = progress.split('/', 1)[0].strip()
        if head.isdigit():
            return int(head)
    step = line.get('step')
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return None


def parse_logging_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    """Parse the lines of ``logging.jsonl``.

    Returns:
        ``(rows, summary, skipped)``: every log event with ``step`` and its numeric values (strings such as
        ``'10.0%'`` converted, others dropped), the summary line (the one with ``log_history``) or None, and the
        number of unreadable lines. A line without a step gets the previous line's step (0 before any).
    """
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] | None = None
    skipped = 0
    last_step = 0
    for text in lines:
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not isinstance(line, dict):
            skipped += 1
            continue
        if 'log_history' in line:
            summary = line
            continue
        step = _step_of(line)
        step = last_step if step is None else step
        last_step = step
        row: dict[str, Any] = {'step': step}
        for key, value in line.items():
            number = parse_number(value)
            if number is not None and key != 'step':
                row[key] = number
        rows.append(row)
    return rows, summary, skipped


def read_logging(path: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    """:func:`parse_logging_lines` of a file."""
    with open(path, encoding='utf-8') as f:
        return parse_logging_lines(f)


def load_run(output_dir: str | os.PathLike) -> RunData:
    """Read a run's output directory.

    Raises:
        ReportError: the directory or its ``logging.jsonl`` does not exist.
    """
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        raise ReportError(f'{output_dir}: no such directory (expected an ms-swift output_dir)')
    log_path = os.path.join(output_dir, LOGGING_FILE)
    if not os.path.isfile(log_path):
        raise ReportError(f'{output_dir}: no {LOGGING_FILE} in it; is this the output_dir of an ms-swift run? '
                          '(with add_version true, pass the versioned subdirectory, e.g. output/v0-...)')
    rows, summary, skipped = read_logging(log_path)
    decisions = read_decisions(output_dir) if os.path.isfile(os.path.join(output_dir, DECISIONS_FILE)) else []
    # applied_request records are the machine-readable trail for replay: the change they carry has its own record
    decisions = [d for d in decisions if d.get('kind') != 'applied_request']
    return RunData(output_dir, rows, summary, decisions, skipped)


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the rows that have it (a later row at the same step replaces it)."""
    by_step: dict[int, float] = {}
    for row in rows:
        if key in row:
            by_step[int(row['step'])] = float(row[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def memory_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The logged memory keys: ms-swift's ``memory(GiB)`` and the pack's ``dynamic/memory_*``."""
    keys = {k for row in rows for k in row if k == SWIFT_MEMORY_KEY or k.startswith(MEMORY_PREFIX)}
    return sorted(keys)


def panels(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The figure's panels that have data: ``[(title, keys with data), ...]`` in display order."""
    wanted = [('batch size', list(BATCH_KEYS)), ('learning rate', list(LR_KEYS)), ('loss', list(LOSS_KEYS)),
              ('memory (GiB)', memory_keys(rows))]
    out = []
    for title, keys in wanted:
        present = [k for k in keys if series(rows, k)[0]]
        if present:
            out.append((title, present))
    return out


def decision_label(decision: Mapping[str, Any]) -> str:
    """A short label for a decision line, e.g. ``batch_size 1->2`` or ``stop``."""
    values = decision.get('values') or {}
    kind = str(decision.get('kind', '?'))
    if 'new' in values:
        old = values.get('old')
        return f'{kind} {"" if old is None else old}->{values["new"]}'
    return kind


def spread_labels(positions: Sequence[float], width: float) -> list[float]:
    """Where to put labels wanted at ``positions`` (one axis, any unit) so that no two are closer than ``width``.

    Labels keep their order along the axis (ties in input order) and each is pushed right just enough: in that
    order, label ``i`` goes to ``max(positions[i], placed[previous] + width)``. Pure; the returned values are in
    the order of ``positions``.
    """
    order = sorted(range(len(positions)), key=lambda i: (positions[i], i))
    placed: dict[int, float] = {}
    last: float | None = None
    for i in order:
        x = positions[i] if last is None else max(positions[i], last + width)
        placed[i] = last = x
    if not placed:
        return []
    return [placed[i] for i in range(len(positions))]


def train_steps(run: RunData) -> int:
    """Optimizer steps of the run: the summary's ``global_step``, else the last logged step."""
    if run.summary and isinstance(run.summary.get('global_step'), int):
        return int(run.summary['global_step'])
    return max((int(r['step']) for r in run.rows), default=0)


def _cell(value: Any) -> str:
    text = '' if value is None else str(value)
    return text.replace('|', '\\|').replace('\n', ' ')


def _fmt(value: float | None) -> str:
    return '-' if value is None else f'{value:.6g}'


def build_markdown(run: RunData, png_name: str | None = REPORT_PNG) -> str:
    """The markdown summary: run length, final loss, batch size and LR range, and a table of every decision."""
    rows = run.rows
    name = os.path.basename(os.path.normpath(run.output_dir)) or run.output_dir
    lines = [f'# Dynamic training report: {name}', '']
    steps = train_steps(run)
    epochs = [r['epoch'] for r in rows if 'epoch' in r]
    run_line = f'- Run: {steps} optimizer steps'
    if epochs:
        run_line += f', {max(epochs):.4g} epochs'
    runtime = next((r['train_runtime'] for r in reversed(rows) if 'train_runtime' in r), None)
    if runtime is not None:
        run_line += f', {runtime:.4g} s'
    lines.append(run_line + ('' if run.summary else ' (no summary line: the run did not finish)'))
    loss_steps, losses = series(rows, 'loss')
    if losses:
        lines.append(f'- Final loss: {_fmt(losses[-1])} (step {loss_steps[-1]}; first {_fmt(losses[0])})')
    eval_steps, eval_losses = series(rows, 'eval_loss')
    if eval_losses:
        first = f'; first {_fmt(eval_losses[0])} at step {eval_steps[0]}' if len(eval_losses) > 1 else ''
        lines.append(f'- Final eval_loss: {_fmt(eval_losses[-1])} (step {eval_steps[-1]}{first})')
    for key, label in (('dynamic/batch_size', 'Per-device batch size'),
                       ('dynamic/global_batch_size', 'Global batch size'), ('learning_rate', 'Learning rate')):
        _, values = series(rows, key)
        if values:
            lines.append(f'- {label}: {_fmt(values[0])} -> {_fmt(values[-1])} (min {_fmt(min(values))}, '
                         f'max {_fmt(max(values))})')
    for key in memory_keys(rows):
        _, values = series(rows, key)
        lines.append(f'- Memory `{key}`: max {_fmt(max(values))} GiB')
    sources: dict[str, int] = {}
    for d in run.decisions:
        sources[str(d.get('source'))] = sources.get(str(d.get('source')), 0) + 1
    by_source = ', '.join(f'{k} {v}' for k, v in sorted(sources.items()))
    lines.append(f'- Decisions: {len(run.decisions)}' + (f' ({by_source})' if by_source else ''))
    if run.skipped_lines:
        lines.append(f'- {run.skipped_lines} unreadable line(s) in {LOGGING_FILE} skipped')
    if png_name:
        lines += ['', f'![training curves and decisions]({png_name})']
    lines += ['', '## Decisions', '']
    if not run.decisions:
        lines.append('No decision records (no dynamic_decisions.jsonl, or it is empty).')
        return '\n'.join(lines) + '\n'
    lines += ['| step | callback | kind | reason | message |', '|---:|---|---|---|---|']
    for d in run.decisions:
        values = d.get('values') or {}
        reason = str(d.get('reason', ''))
        if values.get('pending'):
            reason += ' (pending)'
        message = d.get('message') or ', '.join(f'{k}={v}' for k, v in values.items())
        lines.append(f'| {_cell(d.get("step"))} | {_cell(d.get("source"))} | {_cell(d.get("kind"))} | '
                     f'{_cell(reason)} | {_cell(message)} |')
    return '\n'.join(lines) + '\n'


def source_colours(decisions: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """A fixed colour per decision source (sorted names over matplotlib's ``tab10`` cycle)."""
    palette = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22',
               '#17becf']
    names = sorted({str(d.get('source')) for d in decisions})
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


#: Font size (points) of the decision labels, and the room one rotated label takes across the x axis.
LABEL_FONT_PT = 6.0
LABEL_WIDTH_PT = LABEL_FONT_PT + 2.0


def plot_report(run: RunData, path: str | os.PathLike) -> str:
    """Draw the stacked panels with the decision lines into ``path`` (PNG, Agg backend); returns the path."""
    import matplotlib.pyplot as plt
    fig = draw_report(run)
    path = os.fspath(path)
    fig.savefig(path, dpi=REPORT_DPI)
    plt.close(fig)
    return path


REPORT_DPI = 110


def sparse(steps: list[float], total: float) -> bool:
    """Whether a series is too sparse to be drawn as a line (points only): fewer than 3 points, or a gap between
    two of them over a tenth of the run's ``total`` steps (an evaluation at the start and at the end is two
    measurements, not a trend)."""
    if len(steps) < 3:
        return True
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return max(gaps) > max(1.0, total / 10)


def draw_report(run: RunData) -> Any:
    """The report's matplotlib figure (Agg backend): the panels, a dashed line per decision, and one label per
    decision along the top panel, spread so that labels of one step (or of close steps) never overlap
    (:func:`spread_labels`, in points once the layout is final)."""
    import matplotlib
    matplotlib.use('Agg', force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    chosen = panels(run.rows)
    n = max(len(chosen), 1)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.4 * n + 1.0), sharex=True, squeeze=False, dpi=REPORT_DPI)
    axes = [row[0] for row in axes]
    if not chosen:
        axes[0].text(0.5, 0.5, 'no numeric training values in logging.jsonl', ha='center', va='center',
                     transform=axes[0].transAxes)
    total = max((max(series(run.rows, key)[0], default=0) for _, keys in chosen for key in keys), default=0)
    for ax, (title, keys) in zip(axes, chosen):
        for key in keys:
            steps, values = series(run.rows, key)
            style = 'o' if sparse(steps, total) else '-'
            # steps-pre: the size logged at step s ran during (s-1, s], so a change recorded at step N (applied
            # from step N + 1) shows as a jump at N, on its decision line
            ax.plot(steps, values, style, label=key, drawstyle='steps-pre' if title == 'batch size' else 'default')
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        # the top panel carries the decision labels along its upper edge: its legend goes to the lower right
        ax.legend(loc='lower right' if ax is axes[0] and run.decisions else 'upper left', fontsize=7)
    colours = source_colours(run.decisions)
    placed = [d for d in run.decisions
              if isinstance(d.get('step'), (int, float)) and not isinstance(d.get('step'), bool)]
    for d in placed:
        for ax in axes:
            ax.axvline(d['step'], color=colours[str(d.get('source'))], linestyle='--', linewidth=0.9, alpha=0.7)
    if colours:
        handles = [Line2D([0], [0], color=c, linestyle='--', label=name) for name, c in colours.items()]
        fig.legend(handles=handles, loc='upper right', fontsize=7, title='decisions by', title_fontsize=7)
    axes[-1].set_xlabel('optimizer step')
    name = os.path.basename(os.path.normpath(run.output_dir))
    fig.suptitle(f'{name}: {train_steps(run)} steps, {len(run.decisions)} decisions', fontsize=10, x=0.01,
                 ha='left')
    fig.tight_layout(rect=(0, 0, 0.86 if colours else 1, 0.97))
    # labels after the layout is final: the line positions in points, spread one label width apart
    to_pt = 72.0 / fig.dpi
    wanted = [axes[0].transData.transform((float(d['step']), 0.0))[0] * to_pt for d in placed]
    for d, want, at in zip(placed, wanted, spread_labels(wanted, LABEL_WIDTH_PT)):
        axes[0].annotate(decision_label(d), xy=(d['step'], 1.0), xycoords=('data', 'axes fraction'), rotation=90,
                         fontsize=LABEL_FONT_PT, color=colours[str(d.get('source'))], va='top', ha='center',
                         xytext=(at - want + LABEL_WIDTH_PT / 2, -2), textcoords='offset points',
                         annotation_clip=False)
    return fig


def write_report(output_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> tuple[str, str]:
    """Write ``dynamic_report.png`` and ``dynamic_report.md`` for ``output_dir`` (into ``out_dir``, default the
    same directory). Returns ``(png_path, md_path)``.

    Raises:
        ReportError: no such directory, or no ``logging.jsonl`` in it.
    """
    run = load_run(output_dir)
    out = os.fspath(out_dir) if out_dir is not None else run.output_dir
    os.makedirs(out, exist_ok=True)
    png = plot_report(run, os.path.join(out, REPORT_PNG))
    md = os.path.join(out, REPORT_MD)
    with open(md, 'w', encoding='utf-8') as f:
        f.write(build_markdown(run, REPORT_PNG))
    return png, md
