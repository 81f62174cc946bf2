"""The elastic loader over a stream (``streaming: true``, an ``IterableDataset``): exactly-once, in stream order.

:class:`StreamLoader` is what :class:`~.elastic.ElasticDataLoader` is for a map-style dataset, for a dataset with no
length. Each rank takes its shard of the stream (rows ``rank::world`` of the stream's order, the stream's own
shuffle included); :meth:`StreamLoader.next_step` takes the next rows of the shard for each micro-batch at the
batch size of this step, so a batch-size change applies at the next optimizer step and no row is dropped or read
twice. ``position`` counts the rows of this rank's shard consumed in the current epoch; a resume reads the stream
again from the start of the epoch and skips that many rows (they are read, not trained on), then continues at the
next unseen one. An epoch ends when every rank's shard is used up (a rank whose shard ended first runs placeholder
micro-batches until then); the next epoch calls the dataset's ``set_epoch`` and reads it again.

Length-aware batching (a :class:`~..policies.length.BatchPlan`) works on a bounded **window** of the stream: the next
``window`` rows of the shard are read, laid out (bucketed, with the plan's seed, the epoch and the window's number)
and cut into micro-batches by the plan, exactly as the map-style loader does with a whole epoch; then the next
window. Inside a window rows leave stream order (that is what bucketing is), never the window. The state holds the
window's start and how much of its layout was consumed, so a resume rebuilds the same window.

What needs the dataset's length is not available on a stream (refused by ``config.launch.check_run``): an epoch or
sample budget (``num_train_epochs`` without ``max_steps``, ``max_steps_unit: samples``), ``epoch_coverage``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from typing import Any, Callable, Iterator, Mapping

from torch.utils.data import DataLoader, IterableDataset

from .. import distributed
from ..errors import ConfigError, StateError
from ..policies import length as length_policy
from .interface import BudgetReports
from .rows import item_lengths, row_cost, row_tokens
from .slots import EmptyMicroBatch
from .stats import DrawStats


class _RankShard(IterableDataset):
    """``(stream_index, row)`` of rows ``rank::world`` of ``dataset`` in ``epoch``, after the first ``skip`` of them."""

    def __init__(self, dataset: Any, epoch: int, skip: int, rank: int, world: int) -> None:
        self.dataset, self.epoch, self.skip, self.rank, self.world = dataset, epoch, skip, rank, world

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if hasattr(self.dataset, 'set_epoch'):
            self.dataset.set_epoch(self.epoch)
        start = self.rank + self.skip * self.world
        rows = itertools.islice(iter(self.dataset), start, None, self.world)
        for k, row in enumerate(rows):
            yield start + k * self.world, row


def _identity(item: Any) -> Any:
    return item


class StreamLoader:
    """Training loader over an ``IterableDataset`` whose batch size can change at any optimizer-step boundary.

    Args:
        dataset: the trainer's training dataset (an ``IterableDataset``: ``datasets`` streaming, or torch's).
        collate_fn: the host's collate function.
        batch_size: initial per-device micro-batch size.
        entries_per_step: micro-batches per optimizer step (HF's ``gradient_accumulation_steps``).
        loader_kwargs: ``num_workers`` (at most 1: the stream is read in order by one worker, which encodes ahead of
            training), ``pin_memory``, ``prefetch_factor``, ``timeout``, ... as for a ``DataLoader``.
        window: rows of the shard a batch plan lays out at once (bucketing on a stream).

    State (``state_dict``): ``epoch``, ``position`` (rows of this rank's shard consumed in the epoch),
    ``batch_size``, ``num_pieces``, ``samples_seen``, ``streaming`` (true); with a batch plan ``plan``,
    ``window_start`` (shard row where the current window starts), ``window_taken`` (rows of its layout consumed).
    """

    state_key = 'integration.data'
    has_length = False  # a stream: no epoch size, no epoch budget, no re-deal on another number of processes
    lengths_estimated = False  # each window's rows are encoded, so their lengths are real
    epoch_size = 0  # unknown: a stream has no length

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], *, batch_size: int, entries_per_step: int,
                 loader_kwargs: Mapping[str, Any] | None = None, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f'window: must be >= 1, got {window}')
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        self.entries_per_step = entries_per_step
        self.window = window
        self.num_pieces = 1
        self.epoch = 0
        self.position = 0
        self.samples_seen = 0
        self.loader_kwargs = {k: v for k, v in dict(loader_kwargs or {}).items() if v is not None}
        self.num_workers = min(int(self.loader_kwargs.get('num_workers', 0)), 1)
        self.plan: length_policy.BatchPlan | None = None
        self.stats = DrawStats()
        self._rank, self._world = distributed.data_rank(), distributed.data_world()
        self._source: Iterator[tuple[int, Any]] | None = None
        self._ahead: deque[tuple[int, Any]] = deque()  # rows read from the shard, not yet consumed
        self._exhausted = False  # this rank's shard has no row left after ``_ahead``
        self._complete = False  # every rank's shard is used up (agreed)
        # the window of a batch plan: its rows in layout order, micro-batch sizes left, where it starts
        self._window_rows: list[tuple[int, Any]] = []
        self._window_costs: list[int] = []
        self._window_chunks: list[int] | None = None
        self._window_taken = 0
        self._window_start = 0
        self._window_number = 0
        self._sizes: list[int] = []

    # ---- what HF sees ------------------------------------------------------------------------------
    def __len__(self) -> int:
        raise TypeError('StreamLoader has no length: the training dataset is a stream')

    def __iter__(self) -> Iterator[Any]:
        """Nothing: the HF loop creates this iterator every epoch but the integration draws from :meth:`next_step`
        (a preview would have to read the stream)."""
        return iter(())

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the data epoch is counted here."""

    @property
    def epoch_complete(self) -> bool:
        return self._complete

    @property
    def epoch_progress(self) -> float:
        """Data epochs done: ``epoch`` while it runs (a stream's length is unknown), ``epoch + 1`` at its end."""
        return self.epoch + (1.0 if self._complete else 0.0)

    @property
    def order_bucketed(self) -> bool:
        """Whether windows are bucketed (from the next window on, in the current epoch)."""
        return self.plan is not None and self.plan.bucketing

    @property
    def remaining(self) -> int:
        return 0 if self._complete else 1

    # ---- reading the shard -----------------------------------------------------------------------------
    def _open(self, skip: int) -> None:
        shard = _RankShard(self.dataset, self.epoch, skip, self._rank, self._world)
        if self.num_workers:
            kwargs = {k: v for k, v in self.loader_kwargs.items() if k not in ('num_workers', 'worker_init_fn')}
            kwargs.setdefault('persistent_workers', False)
            self._source = iter(DataLoader(shard, batch_size=None, collate_fn=_identity, num_workers=1, **kwargs))
        else:
            self._source = iter(shard)

    def _fill(self, count: int) -> None:
        """Read rows until ``count`` are ahead or the shard ends."""
        if self._source is None and not self._exhausted:  # rows read but not consumed are not read again
            self._open(self.position + len(self._ahead) + len(self._window_rows) - self._window_taken)
        while len(self._ahead) < count and not self._exhausted:
            try:
                self._ahead.append(next(self._source))
            except StopIteration:
                self._exhausted = True
                self._source = None

    def _take(self, size: int) -> list[tuple[int, Any]]:
        self._fill(size)
        return [self._ahead.popleft() for _ in range(min(size, len(self._ahead)))]

    # ---- windows (with a batch plan) -------------------------------------------------------------------
    def _read_window(self) -> None:
        """Lay out the next ``window`` rows of the shard (bucketed by the plan) and plan their micro-batches."""
        rows = self._take(self.window)
        self._window_start = self.position
        self._window_taken = 0
        self._layout(rows)

    def _layout(self, rows: list[tuple[int, Any]]) -> None:
        plan = self.plan
        costs = [row_cost(item_lengths(row, k)) for k, row in rows]
        seed_epoch = self.epoch * 1_000_003 + self._window_start // self.window
        if plan.bucketing and rows:
            order, chunks = length_policy.epoch_layout(list(range(len(rows))), costs, plan, seed_epoch)
        else:
            order, chunks = list(range(len(rows))), None
        self._window_rows = [rows[i] for i in order]
        self._window_costs = [costs[i] for i in order]
        self._window_chunks = chunks
        if self.plan.length_mode.sizes_by_tokens:
            self.stats.rows_over_budget.extend((rows[i][0], costs[i]) for i in range(len(rows))
                                         if costs[i] > self.plan.max_tokens)
        self._replan()

    def _replan(self) -> None:
        if self.plan is None:
            return
        self._sizes = length_policy.plan_sizes(self._window_costs, self._window_taken, self._window_chunks, self.plan,
                                               self.batch_size)

    def _window_done(self) -> bool:
        return self._window_taken >= len(self._window_rows)

    # ---- changes --------------------------------------------------------------------------------------
    def set_batch_size(self, batch_size: int) -> None:
        if batch_size != self.batch_size:
            self.batch_size = batch_size
            self._replan()

    def set_entries_per_step(self, entries: int) -> None:
        self.entries_per_step = entries

    def set_num_pieces(self, num_pieces: int) -> None:
        """The pieces the step runner cuts each micro-batch into at least (a stream never cuts passes itself)."""
        self.num_pieces = num_pieces

    @property
    def pass_pieces(self) -> int:
        return self.num_pieces

    @property
    def cuts_passes(self) -> bool:
        """A stream never cuts a step into passes by tokens (``pass_tokens`` needs balanced steps)."""
        return False

    @property
    def pass_tokens(self) -> int | None:
        return None

    def set_pass_budget(self, tokens: int | None) -> bool:
        """No passes cut here: nothing to plan again."""
        return False

    def set_plan(self, plan: length_policy.BatchPlan) -> bool:
        """Use ``plan`` from the next unseen row on (a new window starts there); False when it is already the plan."""
        if plan == self.plan:
            return False
        if plan.balanced:
            raise ConfigError(f'length_batching.mode: {plan.mode} is not supported with streaming: true (it lays out '
                              'the whole epoch across ranks; a stream is read in windows); use token_budget or rules')
        if self.plan is not None and not self._window_done():  # the rest of the current window, in stream order
            rest = self._window_rows[self._window_taken:]
            rest.sort(key=lambda item: item[0])
            self._ahead.extendleft(reversed(rest))
        self.plan = plan
        self._window_rows, self._window_costs, self._window_chunks, self._sizes = [], [], None, []
        self._window_taken = 0
        self._window_start = self.position
        return True

    balanced_steps = False  # a stream is never laid out in balanced steps (set_plan refuses them)

    def planned_spread(self) -> dict[str, float]:
        """Balanced steps are not laid out on a stream: nothing to report (the elastic loader's call)."""
        return {}

    def take_spread_stats(self) -> tuple[float, float, int]:
        return 0.0, 0.0, 0

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._complete = self._exhausted = False
        self._source = None
        self._ahead.clear()
        self._window_rows, self._window_costs, self._window_chunks, self._sizes = [], [], None, []
        self._window_taken = self._window_start = 0

    def close(self) -> None:
        self._source = None

    # ---- what the integration reads --------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        """Costs of the current window's rows (in layout order): a stream has no table of every sample's length."""
        return list(self._window_costs)

    def over_budget(self) -> list[int]:
        """Stream indices of the current window's rows longer than ``max_tokens`` (each runs alone)."""
        if self.plan is None:
            return []
        return [self._window_rows[k][0] for k in length_policy.over_budget(self.lengths, self.plan)]

    def planned_padding(self) -> tuple[int, int, int]:
        """``(real, padded, micro_batches)`` planned for the rest of the current window (0s before it is read)."""
        start, batches = self._window_taken, []
        for size in self._sizes:
            batches.append(self._window_costs[start:start + size])
            start += size
        real, padded = length_policy.padding(batches)
        return real, padded, len(batches)

    def take_token_stats(self) -> tuple[int, int, int]:
        return self.stats.take_token_stats()

    def take_reports(self) -> BudgetReports:
        """The rows read over the token budget since the last call (each runs alone)."""
        return self.stats.take_reports()

    def skip_to(self, consumed: int) -> None:
        """Resume by HF's arithmetic (a checkpoint without the pack's state): this rank's first ``consumed`` rows
        of the stream are behind."""
        self.position, self.samples_seen = consumed, consumed

    # ---- drawing -------------------------------------------------------------------------------------
    def _next_micro_batch(self) -> list[tuple[int, Any]]:
        if self.plan is None:
            return self._take(self.batch_size)
        if self._window_done():
            self._read_window()
            if not self._window_rows:
                return []
        size = self._sizes.pop(0)
        rows = self._window_rows[self._window_taken:self._window_taken + size]
        self._window_taken += size
        if self._window_done():  # free the rows; the next window starts after them
            self._window_rows, self._window_costs = [], []
            self._window_taken = 0
            self._window_start = self.position + size
        return rows

    def next_step(self, entries: int) -> list[tuple[list[int], Any]]:
        """Draw the micro-batches of one optimizer step: ``entries`` pairs ``(stream indices, batch)``.

        A rank whose shard ended draws ``([], EmptyMicroBatch())``. Collective under data parallelism: the ranks agree
        whether the epoch is complete after this step.
        """
        if self._complete:
            raise RuntimeError('next_step() called on a complete epoch; call start_next_epoch() first')
        self.set_entries_per_step(entries)
        out: list[tuple[list[int], Any]] = []
        for _ in range(entries):
            rows = self._next_micro_batch()
            if not rows:
                out.append(([], EmptyMicroBatch()))
                continue
            indices = [k for k, _ in rows]
            self.position += len(rows)
            self.samples_seen += len(rows)
            if self.plan is not None:
                lengths = [item_lengths(row, k) for k, row in rows]
                costs = [row_cost(v) for v in lengths]
                real = sum(row_tokens(v) for v in lengths)
                self.stats.count_batch(real, sum(costs) if self.plan.padding_free else len(costs) * max(costs))
            out.append((indices, self.collate_fn([row for _, row in rows])))
        if self.plan is None or self._window_done():
            self._fill(1)  # is there a row left on this rank?
        done = self._exhausted and not self._ahead and (self.plan is None or self._window_done())
        self._complete = all(distributed.gather_objects(done))
        if self._complete:
            self._source = None
        # a real micro-batch after a placeholder: placeholders first, as in a short last step
        out.sort(key=lambda pair: bool(pair[0]))
        return out

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {'epoch': self.epoch, 'position': self.position, 'batch_size': self.batch_size,
                 'num_pieces': self.num_pieces, 'samples_seen': self.samples_seen, 'streaming': True}
        if self.plan is not None:
            state['plan'] = self.plan.to_json()
            state['window_start'] = self._window_start
            state['window_taken'] = self._window_taken
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state.get('streaming'):
            raise StateError('the checkpoint was written for a map-style training dataset, but this run streams it '
                             '(streaming: true); resume with the same dataset settings')
        epoch, position = int(state['epoch']), int(state['position'])
        if epoch < 0 or position < 0:
            raise StateError(f'corrupt loader state: epoch {epoch}, position {position}')
        self.epoch, self.position = epoch, position
        self.batch_size = int(state['batch_size'])
        self.num_pieces = int(state.get('num_pieces', 1))
        self.samples_seen = int(state.get('samples_seen', 0))
        self.plan = length_policy.BatchPlan.from_json(state['plan']) if state.get('plan') else None
        self._complete = self._exhausted = False
        self._source = None
        self._ahead.clear()
        self._window_rows, self._window_costs, self._window_chunks, self._sizes = [], [], None, []
        self._window_taken = 0
        self._window_start = position
        if self.plan is not None:
            start, taken = int(state.get('window_start', position)), int(state.get('window_taken', 0))
            if start + taken != position:
                raise StateError(f'corrupt loader state: window at {start} with {taken} rows taken, but position '
                                 f'{position}')
            if taken:  # rebuild the interrupted window and skip what it had given
                self._window_start = self.position = start
                self._read_window_at(start, taken)

    def _read_window_at(self, start: int, taken: int) -> None:
        self._open(start)
        rows = self._take(self.window)
        self._window_start, self._window_taken = start, 0
        self._layout(rows)
        self.stats.rows_over_budget.clear()  # recorded by the interrupted run
        self._window_taken = taken
        self.position = start + taken
        self._replan()


def stream_fingerprint(dataset: Any, samples: int = 8) -> dict[str, Any]:
    """``{'size': None, 'sha256'}`` of a stream: a hash of the token ids of its first ``samples`` rows (epoch 0)."""
    digest = hashlib.sha256(b'stream')
    if hasattr(dataset, 'set_epoch'):
        dataset.set_epoch(0)
    for item in itertools.islice(iter(dataset), samples):
        ids = item.get('input_ids') if isinstance(item, Mapping) else None
        if ids is None:
            ids = item.get('chosen_input_ids') if isinstance(item, Mapping) else None
        if ids is None:
            return {'size': None, 'sha256': None}
        digest.update(repr([int(x) for x in ids]).encode())
    return {'size': None, 'sha256': digest.hexdigest()}
