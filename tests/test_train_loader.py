"""The loader interface (``data.interface.TrainLoader``): both loaders meet it, the stream without an epoch budget, and
the integration asks what a loader can do through its capability flags, never by probing for attributes."""

from __future__ import annotations

import os
import re

import torch

import swift_dynamic_callbacks
from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.data.stream import StreamLoader
from swift_dynamic_callbacks.data.interface import SizedTrainLoader, TrainLoader, meets


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter({'input_ids': [1] * (3 + i % 5)} for i in range(20))


def test_both_loaders_meet_the_interface_and_only_the_elastic_one_has_a_length():
    elastic = ElasticDataLoader(list(range(10)), list, lambda epoch: list(range(10)), batch_size=2, entries_per_step=1)
    stream = StreamLoader(Stream(), list, batch_size=2, entries_per_step=1)
    assert meets(elastic, TrainLoader) and meets(elastic, SizedTrainLoader) and elastic.has_length
    assert meets(stream, TrainLoader) and not meets(stream, SizedTrainLoader) and not stream.has_length
    assert not stream.lengths_estimated and not stream.balanced_steps
    assert stream.take_reports().rows_over_budget == [] and elastic.take_reports().over_estimates == []
    elastic.skip_to(23)  # HF's arithmetic for a checkpoint without the pack's state: 2 epochs and 3 samples
    assert (elastic.epoch, elastic.position, elastic.samples_seen) == (2, 3, 23)
    stream.skip_to(7)
    assert (stream.position, stream.samples_seen) == (7, 7)


def test_the_integration_never_probes_a_loader_for_attributes():
    folder = os.path.join(os.path.dirname(swift_dynamic_callbacks.__file__), 'integrations')
    for name in os.listdir(folder):
        if name.endswith('.py'):
            with open(os.path.join(folder, name), encoding='utf-8') as f:
                text = f.read()
            assert not re.search(r'getattr\((self\.)?(feed\.)?loader\b', text), name
