"""Shared fixtures: tiny models built offline at test time, vendored real data, an ms-swift run helper."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def _random_dataset_fingerprints() -> None:
    """Test speed only: ``datasets`` names the cache file of every ``map`` by a hash of the transform, and ms-swift's
    encode transform holds the template with its 151k-token tokenizer, so every in-process ``swift sft`` run spent
    seconds dill-pickling it (most of a short run's set-up). A random fingerprint is what ``datasets`` itself uses when
    a transform cannot be hashed: the map still runs (16 rows), only its cache is never reused between runs. The pack's
    own dataset fingerprint (``rows.dataset_fingerprint``) hashes token ids and is not affected."""
    import datasets.arrow_dataset
    import datasets.fingerprint

    def random_fingerprint(fingerprint, transform, transform_args):
        return datasets.fingerprint.generate_random_fingerprint()

    datasets.fingerprint.update_fingerprint = random_fingerprint
    datasets.arrow_dataset.update_fingerprint = random_fingerprint


_random_dataset_fingerprints()


def _map_in_process() -> None:
    """Test speed only: ``datasets`` 4.x runs ``map(num_proc=1)`` in a pool of one worker process, so each in-process
    ``swift sft`` run (ms-swift's ``dataset_num_proc`` is 1 and 0 is refused) pickled its template, 151k-token tokenizer
    included, to a subprocess twice (about 1.7 s of a 3 s set-up). ``num_proc=None`` runs the same map in this process;
    the rows it gives are the same."""
    import functools

    import datasets

    original = datasets.Dataset.map

    @functools.wraps(original)
    def map_in_process(self, *args, **kwargs):
        if kwargs.get('num_proc') == 1:
            kwargs['num_proc'] = None
        return original(self, *args, **kwargs)

    datasets.Dataset.map = map_in_process


_map_in_process()


@pytest.fixture(scope='session')
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp('fixtures')


@pytest.fixture(scope='session')
def tiny_qwen(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    return str(build_tiny_model(fixture_dir / 'tiny-qwen2', 'qwen2'))


@pytest.fixture(scope='session')
def tiny_llama(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    return str(build_tiny_model(fixture_dir / 'tiny-llama', 'llama'))


@pytest.fixture(scope='session')
def gsm8k_16(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-16.jsonl', 16))


def pytest_collection_finish(session):
    """Test speed only: every in-process ``swift sft`` run calls ``gc.collect()`` (accelerate's ``free_memory`` at the
    start of training), and with torch, transformers, ms-swift and the collected tests imported a full collection
    walks millions of long-lived objects (0.4 s a run). ``gc.freeze()`` moves the objects alive after collection out
    of the collector's sight; everything a test creates is collected as before."""
    import gc
    gc.collect()
    gc.freeze()
