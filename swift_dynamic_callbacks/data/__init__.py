"""The data plane: the training loaders and what they are made of.

- :mod:`.interface`: :class:`~.interface.TrainLoader`, the interface the integration calls, met by
  :class:`~.elastic.ElasticDataLoader` (a map-style dataset) and :class:`~.stream.StreamLoader` (a stream).
- The elastic loader's parts, each with its own state: :mod:`.position` (this rank's shard and how far it was used),
  :mod:`.layout` (how an epoch is ordered), :mod:`.cursor` (the micro-batches planned for the rest of the epoch),
  :mod:`.stats` (what was drawn since the last log), :mod:`.prefetch` (the workers that collate ahead).
- Rows and slots: :mod:`.rows` (what a sample costs), :mod:`.length_estimates` (estimated lengths of a lazily
  tokenised dataset), :mod:`.slots` (what fills HF's micro-batch slots: empty ones, groups of passes).

The arithmetic the loaders feed (step sizes, budgets, re-deals, batch plans) is the pure functions of
:mod:`..policies`.
"""

from .elastic import ElasticDataLoader
from .interface import BudgetReports, SizedTrainLoader, TrainLoader, meets
from .slots import EmptyMicroBatch, PassGroup
from .stream import StreamLoader

__all__ = ['BudgetReports', 'ElasticDataLoader', 'EmptyMicroBatch', 'PassGroup', 'SizedTrainLoader', 'StreamLoader',
           'TrainLoader', 'meets']
