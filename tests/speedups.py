"""Test speed only: two ``datasets`` behaviours that cost every ms-swift run of the tests seconds and change no row.

- ``datasets`` names the cache file of every ``map`` by a hash of the transform, and ms-swift's encode transform holds
  the template with its 151k-token tokenizer, so every run spent seconds dill-pickling it. A random fingerprint is what
  ``datasets`` itself uses when a transform cannot be hashed: the map still runs, only its cache is never reused
  between runs (ms-swift's ``load_from_cache_file`` is false by default anyway). The pack's own dataset fingerprint
  (``rows.dataset_fingerprint``) hashes token ids and is not affected.
- ``datasets`` 4.x runs ``map(num_proc=1)`` in a pool of one worker process, so each run (ms-swift's
  ``dataset_num_proc`` is 1 and 0 is refused) pickled its template, tokenizer included, to a subprocess twice.
  ``num_proc=None`` runs the same map in the calling process; the rows it gives are the same.

Together about 10 s a run started in a process of its own (``swift-dynamic pt`` on the demo config: 40 s -> 31 s)
and 5 s an in-process one. :func:`install` patches ``datasets`` as imported now (``conftest.py``);
:func:`install_on_import` patches it when a process first imports it (``child_startup/sitecustomize.py``, on
the ``PYTHONPATH`` of every process the tests start: the command-line runs, the engine tests' ranks).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from types import ModuleType

_MODULE = 'datasets.arrow_dataset'


def _patch(arrow_dataset: ModuleType) -> None:
    import datasets.fingerprint as fingerprint

    def random_fingerprint(fingerprint_, transform, transform_args):
        return fingerprint.generate_random_fingerprint()

    fingerprint.update_fingerprint = random_fingerprint
    arrow_dataset.update_fingerprint = random_fingerprint
    original = arrow_dataset.Dataset.map
    if getattr(original, '_sdc_in_process', False):
        return

    @functools.wraps(original)
    def map_in_process(self, *args, **kwargs):
        if kwargs.get('num_proc') == 1:
            kwargs['num_proc'] = None
        return original(self, *args, **kwargs)

    map_in_process._sdc_in_process = True
    arrow_dataset.Dataset.map = map_in_process


def install() -> None:
    """Patch ``datasets`` now (importing it)."""
    import datasets.arrow_dataset
    _patch(datasets.arrow_dataset)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patch ``datasets.arrow_dataset`` right after its first import, then step aside."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install_on_import() -> None:
    """Patch ``datasets`` when this process first imports it (at once when it already has)."""
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
