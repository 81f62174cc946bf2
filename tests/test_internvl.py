"""A second vision-language family through the same registry: InternVL in the transformers format (InternVL3 /
InternVL3.5 ``-hf``, ms-swift's ``model_type: internvl``, template ``internvl_hf``), whose collated micro-batches hold
every image and video frame as a stack of equal tiles (``pixel_values`` ``[tiles, C, H, W]``), each a fixed number of
``<IMG_CONTEXT>`` tokens in its row. The family is one module (``integrations/input_kinds/tiles.py``) and one layout
rule read from ``config.json`` (``config/models.py`` ``tile_tokens_of``).

Unit layer (any environment): the tiles kind cuts a micro-batch at its rows' tiles (a row without images gets no
``pixel_values``), refuses a batch whose tokens are not whole tiles (recovery off with the reason, never a wrong cut),
the layout and the vision shape come from the config, ``check`` refuses the pack's padding-free packing before the
model loads. End to end (``vl``: ms-swift's InternVL template needs ``torchvision``): real ``swift sft`` LoRA runs of
a tiny random InternVL on generated images, each way of cutting a micro-batch against the run without it (2e-4). At
36c848d the family had OOM recovery off and every pass setting refused (the ``multimodal`` layout)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from swift_dynamic_callbacks.config.models import layout_of, model_facts, tile_tokens_of, vision_shape_of
from swift_dynamic_callbacks.integrations.input_kinds import Tiles, VisionBatch

CONTEXT = 151667
#: a tiny InternVL's config.json, as build_tiny_internvl_model writes it (the fields the layout rule reads)
CONFIG = {'model_type': 'internvl', 'architectures': ['InternVLForConditionalGeneration'], 'image_token_id': CONTEXT,
          'downsample_ratio': 0.5, 'vision_config': {'model_type': 'internvl_vision', 'image_size': [56, 56],
                                                      'patch_size': [14, 14], 'hidden_size': 32,
                                                      'intermediate_size': 64, 'num_hidden_layers': 2},
          'text_config': {'model_type': 'qwen2', 'hidden_size': 64}}


def _batch(row_tiles: list[int], *, tile_tokens: int = 4, length: int = 24) -> dict:
    """A collated tiles micro-batch: row ``r`` holds ``row_tiles[r]`` tiles of ``tile_tokens`` context tokens each; tile
    ``t`` of the batch is filled with ``t`` so that a piece's tiles can be told."""
    rows = len(row_tiles)
    ids = torch.arange(rows * length).view(rows, length) % 1000
    for r, tiles in enumerate(row_tiles):
        ids[r, 2:2 + tiles * tile_tokens] = CONTEXT
    total = sum(row_tiles)
    batch = {'input_ids': ids, 'labels': ids.clone(), 'attention_mask': torch.ones_like(ids)}
    if total:
        batch['pixel_values'] = torch.arange(total, dtype=torch.float32).view(total, 1, 1, 1).expand(total, 3, 4, 4)
    return batch


def test_the_layout_and_the_tower_come_from_the_config(tmp_path):
    """``tiles`` from the structure of the config (a renamed model type is the same layout); a tile is
    ``(56 / 14)^2 x 0.5^2`` = 4 tokens; the tower's shape for the cost model (4 patches a token, a plain MLP); a config
    without ``downsample_ratio`` (another family's tiles) stays ``multimodal``; ``check`` reads it from the folder."""
    assert layout_of(CONFIG) == 'tiles' and tile_tokens_of(CONFIG) == 4
    assert layout_of({**CONFIG, 'model_type': 'internvl_next', 'architectures': ['X']}) == 'tiles'
    shape = vision_shape_of(CONFIG)
    assert (shape.width, shape.intermediate, shape.depth, shape.gated, shape.merge) == (32, 64, 2, False, 4)
    assert layout_of({k: v for k, v in CONFIG.items() if k != 'downsample_ratio'}) == 'multimodal'
    assert tile_tokens_of({**CONFIG, 'downsample_ratio': 0.3}) is None  # 16 x 0.09 tokens: not whole
    (tmp_path / 'config.json').write_text(json.dumps(CONFIG))
    facts = model_facts({'model': str(tmp_path)})
    assert facts.layout == 'tiles' and facts.vision_rows and not facts.qwen_vl
    assert model_facts({'model_type': 'internvl'}).layout == 'tiles'
    assert model_facts({'model_type': 'internvl_chat'}).layout is None  # the remote-code format: not this layout


def test_tiles_are_cut_at_their_rows():
    """Three rows of 2, 0 and 1 tiles: each piece gets its rows' tiles in order; a piece of the row without images
    gets no ``pixel_values``; the cost model's patches are a tile's tokens x 4 a row."""
    kind = Tiles('model_type: internvl', image_token_id=CONTEXT, tile_tokens=4, merge=4)
    batch = _batch([2, 0, 1])
    assert kind.refusal(batch) is None
    prepared = kind.prepare(batch)
    assert isinstance(prepared, VisionBatch) and prepared.row_media == {'tile': (2, 0, 1)}
    assert kind.vision_patches(prepared) == [32, 0, 16]
    first, middle, last = kind.cut(prepared, [(0, 1), (1, 2), (2, 3)])
    assert first['pixel_values'][:, 0, 0, 0].tolist() == [0.0, 1.0]
    assert 'pixel_values' not in middle
    assert last['pixel_values'][:, 0, 0, 0].tolist() == [2.0]
    for piece, row in zip((first, middle, last), range(3)):
        assert torch.equal(piece['input_ids'], batch['input_ids'][row:row + 1])
        assert torch.equal(piece['labels'], batch['labels'][row:row + 1])
    [whole] = kind.cut(prepared, [(0, 3)])
    assert torch.equal(whole['pixel_values'], batch['pixel_values'])
    assert kind.cut(_batch([0, 0]), [(0, 1), (1, 2)])[0].keys() == {'input_ids', 'labels', 'attention_mask'}


def test_a_batch_that_is_not_whole_tiles_is_refused_not_cut():
    """Context tokens that are not whole tiles of ``pixel_values`` (another tile size than the config's, or tiles
    missing): refused with the counts, so the step runner turns recovery off for the run instead of cutting it wrong;
    a key the kind does not know is named."""
    kind = Tiles('model_type: internvl', image_token_id=CONTEXT, tile_tokens=4)
    odd = _batch([2, 1], tile_tokens=3)
    assert 'not whole tiles' in kind.refusal(odd) and 'model_type: internvl' in kind.refusal(odd)
    missing = _batch([2, 1])
    missing['pixel_values'] = missing['pixel_values'][:2]
    assert '2 tiles' in kind.refusal(missing)
    assert kind.prepare(missing) is missing
    sizes = {**_batch([1, 1]), 'image_sizes': torch.ones(3, 2)}
    assert "'image_sizes'" in kind.refusal(sizes)


def test_check_refuses_the_packs_padding_free_packing_before_the_model_loads(tmp_path):
    """``length_batching.padding_free: true`` with a tiles model: ``check`` exits 2 naming it, from the folder's
    config.json (no weights in the folder); ``micro_batch_cap`` is accepted (at 36c848d: refused, a multimodal model
    no kind cuts)."""
    import subprocess
    import sys
    import yaml
    (tmp_path / 'config.json').write_text(json.dumps(CONFIG))
    base = {'model': str(tmp_path), 'model_type': 'internvl', 'template': 'internvl_hf', 'dataset': ['d.jsonl'],
            'per_device_train_batch_size': 4}
    results = {}
    for name, section in (('padding_free', {'length_batching': {'padding_free': True, 'bucketing': False}}),
                          ('cap', {'batch_growth': {'initial': 4, 'interval': 10, 'maximum': 4,
                                                    'micro_batch_cap': 2}})):
        path = tmp_path / f'{name}.yaml'
        path.write_text(yaml.safe_dump({**base, 'callbacks': list(section), 'dynamic_callbacks': section}))
        results[name] = subprocess.run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'check', str(path)],
                                       capture_output=True, text=True, timeout=60)
    assert results['padding_free'].returncode == 2, results['padding_free'].stderr
    assert 'padding_free' in results['padding_free'].stderr and 'images' in results['padding_free'].stderr
    assert results['cap'].returncode == 0, results['cap'].stdout + results['cap'].stderr


# ---- end to end ---------------------------------------------------------------------------------------------------
VL_READY = importlib.util.find_spec('torchvision') is not None
RUN = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, lora_dropout=0.0,
           learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=1000)
FIXED = {'batch_schedule': {'schedule': {0: 4}}, 'integration': {'record_samples': True}}
BALANCED = {**FIXED, 'length_batching': {'mode': 'balanced'}}
#: how each arm cuts a micro-batch of 4 rows: (the pack's settings, the OOM injector's settings, ms-swift overrides,
#: the uncut run it is held against)
SPLITS = {
    'oom_forward': (FIXED, {'forward_passes': (1, )}, {}, 'fixed'),  # step 1's second micro-batch: 4 rows
    'oom_backward': (FIXED, {'fail_passes': (2, )}, {}, 'fixed'),  # step 2's first micro-batch, mid-backward
    'micro_batch_cap': ({'batch_growth': {'initial': 4, 'interval': 1000, 'maximum': 4, 'micro_batch_cap': 2},
                         'integration': {'record_samples': True}}, {}, {}, 'fixed'),
    # the same balanced steps in passes of at most 250 tokens, the tower's work priced
    'pass_tokens_trained_tower': ({**FIXED, 'length_batching': {'mode': 'balanced', 'pass_tokens': 250}}, {},
                                  {'freeze_vit': False}, 'balanced_trained'),
}
#: CI time: a forward OOM's cut is the backward one's (the step runs again in halves either way); the trained tower's
#: pass_tokens arm needs a second uncut run
SLOW = ('oom_forward', 'pass_tokens_trained_tower')
#: the uncut runs: (the pack's settings, ms-swift overrides)
PLAIN = {'fixed': (FIXED, {}), 'balanced_trained': (BALANCED, {'freeze_vit': False})}


@pytest.fixture(scope='module')
def internvl(fixture_dir):
    if not VL_READY:
        pytest.skip('torchvision is not installed (scripts/test_vl.sh)')
    from swift_dynamic_callbacks.testing.tiny import write_image_dataset
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_internvl_model
    return (str(build_tiny_internvl_model(fixture_dir / 'tiny-internvl')),
            str(write_image_dataset(fixture_dir / 'internvl' / 'rows.jsonl', 28)))


def _run(model, data, out, pack, faults, **extra):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_runs import run_sft, train_logs
    try:
        sdc.register(**pack)
        with OomInjector(**faults) as injector:
            run_sft(model, 'internvl', data, out, callbacks=[k for k in pack if k != 'integration'],
                    **{**RUN, **extra})
    finally:
        plugin.unregister()
    return train_logs(out), injector


_PLAIN: dict[str, list[dict]] = {}


def _plain(internvl, tmp_path_factory, name: str) -> list[dict]:
    """The run a split is held against (:data:`PLAIN`): micro-batches of 4, never cut (once each)."""
    if name not in _PLAIN:
        model, data = internvl
        pack, extra = PLAIN[name]
        logs, _ = _run(model, data, str(tmp_path_factory.mktemp(f'plain-internvl-{name}')), pack, {}, **extra)
        assert max(r['dynamic/pass_size'] for r in logs) == 4
        _PLAIN[name] = logs
    return _PLAIN[name]


@pytest.mark.vl
@pytest.mark.e2e
@pytest.mark.parametrize('split', [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SPLITS])
def test_every_split_of_an_internvl_micro_batch_keeps_the_gradient(split, internvl, tmp_path, tmp_path_factory):
    """An injected OOM in forward and in backward, ``micro_batch_cap: 2``, and ``pass_tokens`` with the vision tower
    trained (priced by the cost model): every step's loss and grad_norm equal the run without them (2e-4), the
    micro-batches did run in pieces, the ``engine`` record names the tiles kind with recovery on, and the epoch
    trained every row once."""
    from swift_runs import decisions, indices_by_epoch, sample_trace
    model, data = internvl
    pack, faults, extra, reference = SPLITS[split]
    plain = _plain(internvl, tmp_path_factory, reference)
    out = str(tmp_path / split)
    logs, injector = _run(model, data, out, pack, faults, **extra)
    assert len(logs) == len(plain) == RUN['max_steps']
    for a, b in zip(plain, logs):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (split, a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (split, a, b)
    assert min(r['dynamic/pass_size'] for r in logs) < 4  # the micro-batches did run in pieces
    [engine] = [d for d in decisions(out) if d['kind'] == 'engine']
    assert engine['values']['input_kind'] == 'tiles' and engine['values']['oom_recovery'] is True, engine
    if split.startswith('oom'):
        assert sum(injector.counts.values()) == 1 and logs[-1]['dynamic/oom_count'] == 1
    if 'freeze_vit' in extra:
        assert engine['values']['vision_trained'] is True and engine['values']['vision_token_cost'] > 0
    epochs = indices_by_epoch(sample_trace(out))  # 28 rows: 4 steps of 7 micro-batches of 4, the last step's one
    assert list(epochs) == [0] and sorted(epochs[0]) == list(range(28))
