"""Vision-language rows (Qwen2-VL, Qwen2.5-VL): every split of a collated micro-batch keeps the gradient.

Unit layer (any environment): the Qwen-VL input kind cuts a collated micro-batch at its rows' images (``pixel_values``
at the cumulative patch counts of ``image_grid_thw``, ``position_ids`` ``[3, B, L]`` on its rows' axis, videos and
``second_per_grid_ts`` alike); the text kind refuses media keys even when their count equals the rows; a key no kind
cuts turns OOM recovery off at the step boundary, naming it. End to end (``vl``: ms-swift's Qwen-VL templates need
``qwen-vl-utils`` and ``torchvision``, which ``scripts/test_vl.sh`` installs in their own environment): real ``swift
sft`` LoRA runs of tiny random Qwen2-VL / Qwen2.5-VL models on generated images, each way of cutting a micro-batch
against the run without it.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.input_kinds import (QwenVL, TextRows, Unsupported, VisionBatch,
                                                               select_input_kind)

IMAGE, VIDEO = 151655, 151656


def _batch(rows_images: list[list[int]], *, length: int = 12, videos: list[list[int]] | None = None) -> dict:
    """A collated Qwen-VL micro-batch: row ``r`` holds images of ``rows_images[r]`` image tokens each (4 patches a
    token: merge 2); patches are numbered so that a piece's patches can be checked; ``videos`` likewise."""
    rows = len(rows_images)
    ids = torch.zeros(rows, length, dtype=torch.long)
    grids, patches, video_grids, video_patches, seconds = [], [], [], [], []
    for r, images in enumerate(rows_images):
        at = 0
        for tokens in images:
            ids[r, at:at + tokens] = IMAGE
            at += tokens
            grids.append([1, 2, 2 * tokens])  # t h w: 4 * tokens patches
            patches.append(torch.full((4 * tokens, 3), float(len(grids))))
        for tokens in (videos or [[]] * rows)[r]:
            ids[r, at:at + tokens] = VIDEO
            at += tokens
            video_grids.append([2, 2, tokens])  # 4 * tokens patches
            video_patches.append(torch.full((4 * tokens, 3), -float(len(video_grids))))
            seconds.append(float(len(video_grids)))
    batch = {'input_ids': ids, 'labels': ids.clone(), 'attention_mask': torch.ones_like(ids),
             'position_ids': torch.arange(3 * rows * length).view(3, rows, length),
             'text_position_ids': torch.arange(length).expand(rows, length)}
    if grids:
        batch.update(pixel_values=torch.cat(patches), image_grid_thw=torch.tensor(grids))
    if video_grids:
        batch.update(pixel_values_videos=torch.cat(video_patches), video_grid_thw=torch.tensor(video_grids),
                     second_per_grid_ts=seconds)
    return batch


def test_qwen_vl_cuts_at_the_rows_images():
    """Three rows (so that ``position_ids`` ``[3, 3, L]`` and three images would pass a dim-0 slicer): row 0 two
    images, row 1 none, row 2 one; each piece gets its rows' patches and grids, and the 3-D positions of its rows."""
    batch = _batch([[2, 1], [], [3]])
    kind = QwenVL()
    assert kind.refusal(batch) is None
    prepared = kind.prepare(batch)
    assert isinstance(prepared, VisionBatch) and prepared.row_media['image'] == (2, 0, 1)
    assert kind.vision_patches(prepared) == [12, 0, 12]
    first, middle, last = kind.cut(prepared, [(0, 1), (1, 2), (2, 3)])
    assert torch.equal(first['pixel_values'], batch['pixel_values'][:12]) and first['image_grid_thw'].shape == (2, 3)
    assert 'pixel_values' not in middle and 'image_grid_thw' not in middle  # ms-swift's placeholder image
    assert torch.equal(last['pixel_values'], batch['pixel_values'][12:]) and last['image_grid_thw'].tolist() == [[1, 2,
                                                                                                                  6]]
    for piece, row in ((first, 0), (middle, 1), (last, 2)):
        assert torch.equal(piece['position_ids'], batch['position_ids'][:, row:row + 1])
        assert torch.equal(piece['input_ids'], batch['input_ids'][row:row + 1])
    two = kind.cut(prepared, [(0, 2), (2, 3)])
    assert torch.equal(torch.cat([two[0]['pixel_values'], two[1]['pixel_values']]), batch['pixel_values'])


def test_qwen_vl_cuts_videos_and_their_seconds():
    batch = _batch([[1], [2]], videos=[[2], [1, 1]])
    kind = QwenVL()
    first, second = kind.cut(kind.prepare(batch), [(0, 1), (1, 2)])
    assert first['second_per_grid_ts'] == [1.0] and second['second_per_grid_ts'] == [2.0, 3.0]
    assert first['pixel_values_videos'].shape[0] == 8 and second['pixel_values_videos'].shape[0] == 8
    assert (second['pixel_values_videos'] < -1).all() and first['video_grid_thw'].shape == (1, 3)


def test_a_one_row_batchs_packing_keys_stay_with_it_whole():
    """ms-swift's Qwen-VL collator gives a one-row micro-batch ``cu_seq_lens_q/k`` and ``max_length_q/k`` (its text
    positions' boundaries, transformers >= 4.53): the kind knows them (no refusal, so OOM recovery stays on from a
    batch of 1), keeps them on the row whole, and a piece of a batch of several rows never carries them."""
    kind = QwenVL()
    one = _batch([[2]])
    one.update(cu_seq_lens_q=torch.tensor([0, 12], dtype=torch.int32), cu_seq_lens_k=torch.tensor([0, 12]),
               max_length_q=torch.tensor(12), max_length_k=torch.tensor(12))
    assert kind.refusal(one) is None
    [whole] = kind.cut(kind.prepare(one), [(0, 1)])
    assert torch.equal(whole['cu_seq_lens_q'], one['cu_seq_lens_q']) and int(whole['max_length_k']) == 12
    two = _batch([[2], [1]])
    two.update(cu_seq_lens_q=torch.tensor([0, 12, 24]))  # not what ms-swift collates: refused, never sliced as rows
    assert 'cu_seq_lens_q' in kind.refusal(two)
    first, _ = kind.cut(kind.prepare(_batch([[2], [1]])), [(0, 1), (1, 2)])
    assert not set(first) & {'cu_seq_lens_q', 'max_length_q'}


def test_a_key_no_kind_cuts_is_named():
    text = TextRows('model_type: qwen2')
    assert text.refusal({'input_ids': torch.ones(3, 4), 'pixel_values': torch.ones(3, 5)}).startswith(
        "micro-batch key 'pixel_values' holds images")  # three images in three rows: never sliced as rows
    assert "'weird' of shape (2, 4)" in text.refusal({'input_ids': torch.ones(3, 4), 'weird': torch.ones(2, 4)})
    assert text.refusal({'input_ids': torch.ones(3, 4), 'labels': torch.ones(3, 4), 'num': 3}) is None
    assert 'cross_attention' in QwenVL('model_type: qwen2_vl').refusal(
        {'input_ids': torch.ones(3, 4), 'cross_attention': torch.ones(2, 2)})
    assert 'model_type: llava' in Unsupported('model_type: llava').refusal({})


def _trainer(model_type, multimodal, **config):
    meta = SimpleNamespace(is_multimodal=multimodal)
    cfg = SimpleNamespace(model_type=model_type, **config)
    return SimpleNamespace(model=SimpleNamespace(model_info=SimpleNamespace(model_type=model_type, config=cfg)),
                           template=SimpleNamespace(model_meta=meta))


def test_the_kind_follows_the_model():
    """The kind is chosen by the layout the model's config describes, not by a list of names: a Qwen model type the
    pack has never seen with the Qwen-VL layout is cut as Qwen-VL rows."""
    vision = SimpleNamespace(spatial_merge_size=2, temporal_patch_size=2)
    kind = select_input_kind(_trainer('qwen2_5_vl', True, vision_config=vision, image_token_id=7, video_token_id=8))
    assert isinstance(kind, QwenVL) and kind.token_ids == {'image_token_id': 7, 'video_token_id': 8}
    new = select_input_kind(_trainer('qwen3_9', True, vision_config=vision, image_token_id=7, video_token_id=8))
    assert isinstance(new, QwenVL)
    assert isinstance(select_input_kind(_trainer('qwen2', False)), TextRows)
    assert isinstance(select_input_kind(_trainer('llava1_5_hf', True)), Unsupported)
    glm = select_input_kind(_trainer('glm4v', True, vision_config=vision, image_token_id=7, video_token_id=8))
    assert isinstance(glm, Unsupported) and 'model_type: glm4v' in glm.refusal({})


def test_a_key_the_kind_cannot_cut_turns_recovery_off_at_the_boundary():
    """At the step boundary, before any pass: OOM recovery off (an ``oom_recovery`` record naming the key) and every
    later split refused; where the step would cut a micro-batch already, the run stops there with the key."""
    from swift_dynamic_callbacks.integrations.engines import Engine
    from swift_dynamic_callbacks.integrations.steps import StepRunner
    trainer = SimpleNamespace(args=SimpleNamespace(padding_free=False, packing=False), template=None,
                              state=SimpleNamespace(global_step=3))
    runner = StepRunner(trainer, Engine(trainer), oom_recovery=True, single_sample_retries=0)
    bad = {'input_ids': torch.ones(2, 4), 'image_sizes': torch.ones(2, 2)}
    record = runner.check_inputs([{'input_ids': torch.ones(2, 4)}, bad])
    assert record.kind == 'oom_recovery' and record.reason == 'off' and "'image_sizes'" in record.values['why']
    assert not runner.oom_recovery and not runner.splittable() and "'image_sizes'" in runner.split_refusal()
    assert runner.check_inputs([bad]) is None  # said once
    other = StepRunner(trainer, Engine(trainer), oom_recovery=True, single_sample_retries=0)
    with pytest.raises(ConfigError, match="'image_sizes'"):
        other.check_inputs([bad], pieces=2)


# ---- end to end ---------------------------------------------------------------------------------------------------
VL_READY = all(importlib.util.find_spec(m) is not None for m in ('qwen_vl_utils', 'torchvision'))
needs_vl = pytest.mark.skipif(not VL_READY, reason='qwen-vl-utils / torchvision are not installed (scripts/test_vl.sh)')
RUN = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, lora_dropout=0.0,
           learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=1000)


@pytest.fixture(scope='module', params=['qwen2_vl', 'qwen2_5_vl'])
def vl_model(request, fixture_dir):
    if not VL_READY:
        pytest.skip('qwen-vl-utils / torchvision are not installed (scripts/test_vl.sh)')
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_vl_model
    return request.param, str(build_tiny_vl_model(fixture_dir / f'tiny-{request.param}', request.param))


@pytest.fixture(scope='module')
def vl_rows(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_image_dataset
    return str(write_image_dataset(fixture_dir / 'vl' / 'rows.jsonl', 28))


@pytest.fixture(scope='module')
def vl_plain(vl_model, vl_rows, tmp_path_factory):
    """The run every split is held against: micro-batches of 4, never cut (once per architecture)."""
    arch, model = vl_model
    logs, _ = _vl_run(model, arch, vl_rows, str(tmp_path_factory.mktemp(f'plain-{arch}')),
                      {'batch_schedule': {'schedule': {0: 4}}})
    assert max(r['dynamic/pass_size'] for r in logs) == 4
    return logs


def _vl_run(model, arch, data, out, pack, *, inject=(), **extra):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_runs import run_sft, train_logs
    try:
        sdc.register(**pack)
        with OomInjector(forward_passes=inject) as injector:
            run_sft(model, arch, data, out, callbacks=[k for k in pack if k != 'integration'], **{**RUN, **extra})
    finally:
        plugin.unregister()
    return train_logs(out), injector


SPLITS = {
    'oom': ({'batch_schedule': {'schedule': {0: 4}}}, {'inject': (1, )}),  # step 1's second pass: 4 rows
    'memory_backoff': ({'batch_schedule': {'schedule': {0: 4}}, 'memory_backoff': {'probe': 'cpu',
                                                                                    'cpu_budget_gib': 0.05}}, {}),
    'micro_batch_cap': ({'batch_growth': {'initial': 4, 'interval': 1000, 'maximum': 4, 'micro_batch_cap': 2}}, {}),
    'split_passes': ({'batch_schedule': {'schedule': {0: 4}},
                      'length_batching': {'split': 'passes', 'bucketing': False, 'micro_batch_tokens': 160}}, {}),
}


@pytest.mark.vl
@pytest.mark.e2e
@needs_vl
@pytest.mark.parametrize('split', list(SPLITS))
def test_every_split_of_a_vl_micro_batch_keeps_the_gradient(split, vl_model, vl_rows, vl_plain, tmp_path):
    """One injected OOM in a pass of 4 rows, ``memory_backoff`` acting (a CPU budget far below the process: passes
    halve every step), ``micro_batch_cap: 2`` and ``split: passes``: every step's loss and grad_norm equal the run
    without them (2e-4), the passes did run in pieces, and no run raises (at 03097fd each raised ``ValueError: cannot
    split micro-batch key 'pixel_values'``)."""
    arch, model = vl_model
    plain = vl_plain
    pack, extra = SPLITS[split]
    logs, injector = _vl_run(model, arch, vl_rows, str(tmp_path / split), pack, **extra)
    assert len(logs) == len(plain) == RUN['max_steps']
    for a, b in zip(plain, logs):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (split, a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (split, a, b)
    assert min(r['dynamic/pass_size'] for r in logs) < 4  # the micro-batches did run in pieces
    if split == 'oom':
        assert injector.counts['forward'] == 1 and logs[-1]['dynamic/oom_count'] == 1



@pytest.mark.vl
@pytest.mark.e2e
@needs_vl
def test_a_trained_vision_towers_work_cuts_the_pass_and_keeps_the_gradient(fixture_dir, vl_rows, tmp_path,
                                                                          monkeypatch):
    """``freeze_vit: false`` (LoRA on the vision tower too): the planner (each lazily tokenised row's image tokens
    from its estimate) and the step runner (each row's patches) price the tower's work (the ``engine`` record's
    ``vision_token_cost``, read from the model's config, ``vision_trained``), so rows ``pass_tokens`` fits in one
    pass by their language-model tokens alone run in several where their images' work does not fit. The
    tiny tower is light next to its 151,936-row logits (about 0.007 tokens an image token); its blocks are priced
    10,000 x heavier here (about 70 tokens an image token, a 7B's tower is about 1), and the cut passes give the
    gradient of the uncut steps (2e-4)."""
    from swift_dynamic_callbacks.policies import pass_cost
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_vl_model
    from swift_runs import decisions
    if not VL_READY:
        pytest.skip('qwen-vl-utils / torchvision are not installed (scripts/test_vl.sh)')
    arch = 'qwen2_5_vl'
    model = str(build_tiny_vl_model(fixture_dir / f'tiny-{arch}', arch))
    runs = {}
    for name, factor, budget in (('uncut', 1.0, None), ('light', 1.0, 4000), ('heavy', 1e4, 4000)):
        monkeypatch.setattr(pass_cost, 'VISION_BLOCK_FACTOR', factor)
        pack = {'length_batching': {'mode': 'balanced', 'pass_tokens': budget}}
        out = str(tmp_path / name)
        logs, _ = _vl_run(model, arch, vl_rows, out, pack, freeze_vit=False)
        [engine] = [d for d in decisions(out) if d['kind'] == 'engine']
        runs[name] = logs, engine['values']
    (uncut, light, heavy), values = [runs[n][0] for n in runs], runs['heavy'][1]
    assert values['vision_trained'] is True and values['vision_checkpointing'] is False
    assert runs['light'][1]['vision_token_cost'] < 0.1 < 10 < values['vision_token_cost']
    assert len(uncut) == len(heavy) == RUN['max_steps']
    for a, b in zip(uncut, heavy):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (a, b)
    # the budget holds a step's 8 rows in one pass by their tokens; their images' work cuts it
    assert max(r['dynamic/pass_size'] for r in light) == 8
    assert max(r['dynamic/pass_size'] for r in heavy) < 8


@pytest.mark.vl
@pytest.mark.e2e
@needs_vl
def test_growth_from_one_row_with_a_cap_keeps_the_gradient_and_every_row(vl_model, vl_rows, tmp_path):
    """The usual VL start, ``per_device_train_batch_size: 1``, grown 1 -> 2 -> 4 with ``micro_batch_cap: 2``: the run
    ends (at f3c4471 it stopped at step 4 on ms-swift's one-row packing keys, ``cu_seq_lens_q``), OOM recovery stays on
    from a one-row batch, the batches of 4 ran as passes of 2, every row at most once, and every step's loss and
    grad_norm equal the same growth uncut (2e-4)."""
    from swift_runs import decisions, indices_by_epoch, sample_trace
    arch, model = vl_model
    growth = {'initial': 1, 'factor': 2.0, 'interval': 1, 'maximum': 4}
    runs = {}
    for name, cap in (('uncut', {}), ('capped', {'micro_batch_cap': 2})):
        pack = {'batch_growth': {**growth, **cap}, 'integration': {'record_samples': True}}
        runs[name], _ = _vl_run(model, arch, vl_rows, str(tmp_path / name), pack, per_device_train_batch_size=1)
    uncut, capped = runs['uncut'], runs['capped']
    assert len(uncut) == len(capped) == RUN['max_steps']
    for a, b in zip(uncut, capped):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (a, b)
    assert [r['dynamic/pass_size'] for r in capped][-1] == 2 and [r['dynamic/pass_size'] for r in uncut][-1] == 4
    seen = indices_by_epoch(sample_trace(str(tmp_path / 'capped')))[0]
    assert len(seen) == len(set(seen)) == 2 * (1 + 2 + 4 + 4)
    assert seen == indices_by_epoch(sample_trace(str(tmp_path / 'uncut')))[0]
    [engine] = [d for d in decisions(str(tmp_path / 'capped')) if d['kind'] == 'engine']
    assert engine['values']['oom_recovery'] is True
    assert not [d for d in decisions(str(tmp_path / 'capped')) if d['kind'] == 'oom_recovery']


@pytest.mark.vl
@pytest.mark.e2e
@needs_vl
def test_lazy_lengths_count_each_rows_own_images(vl_model, tmp_path):
    """Lazily tokenised VL rows (ms-swift's default for VL models): 128 rows, the 64 the estimate encodes hold small
    images (56 x 56: 4 image tokens), the others large ones (up to 63 tokens). Each row's images are counted from its
    file headers with the template's resize rule, so no row's estimate is below its real encoded length by more than
    5 % (at 03097fd a line through characters gave the unsampled rows about 40 tokens for up to 99)."""
    from swift.pipelines.train.sft import SwiftSft

    from swift_dynamic_callbacks.data.length_estimates import estimate_lengths
    from swift_dynamic_callbacks.data.rows import item_lengths, row_cost
    from swift_dynamic_callbacks.integrations.input_kinds import select_input_kind
    from swift_dynamic_callbacks.policies.vision import image_tokens
    from swift_dynamic_callbacks.testing.tiny import write_image_dataset
    from swift_runs import sft_kwargs
    arch, model = vl_model
    n, sample = 128, 64
    picked = {round(i * (n - 1) / (sample - 1)) for i in range(sample)}
    large = [(252, 196), (224, 224), (196, 252), (168, 224)]
    sizes = [(56, 56) if i in picked else large[i % len(large)] for i in range(n)]
    data = str(write_image_dataset(tmp_path / 'lazy.jsonl', n, text_every=0, sizes=sizes))
    sft = SwiftSft(SftArguments_for(model, arch, data, str(tmp_path / 'out'), sft_kwargs))
    [dataset, _] = sft._prepare_dataset()
    assert type(dataset).__name__ == 'LazyLLMDataset'
    trainer = SimpleNamespace(model=sft.model, template=sft.template)
    rule = select_input_kind(trainer).image_rule(trainer)
    estimates, info = estimate_lengths(dataset, lambda item, i: row_cost(item_lengths(item, i)), sample=sample,
                                       image_tokens=lambda w, h: image_tokens(w, h, rule))
    real = [row_cost(item_lengths(dataset[i], i)) for i in range(n)]
    low = [(i, e, r) for i, (e, r) in enumerate(zip(estimates, real)) if e < 0.95 * r]
    assert not low, (low[:8], info)
    assert info['image_tokens'] > 0 and max(e / r for e, r in zip(estimates, real)) < 2
    chars_only, _ = estimate_lengths(dataset, lambda item, i: row_cost(item_lengths(item, i)), sample=sample)
    assert min(e / r for e, r in zip(chars_only, real)) < 0.9  # a line through characters alone: 20 % low


def SftArguments_for(model, arch, data, out, kwargs):  # noqa: N802 - the arguments of one lazily tokenised VL run
    from swift import SftArguments
    return SftArguments(**kwargs(model, arch, data, out, lazy_tokenize=True, dataset_shuffle=False))


@pytest.mark.vl
@pytest.mark.e2e
@needs_vl
def test_lazy_vl_rows_under_a_token_budget_train_every_row_once(vl_model, vl_rows, tmp_path):
    """ms-swift's default for a VL model (rows tokenised when read) under ``length_batching``'s token budget: the
    lengths are estimated with each row's images counted (the ``length_estimate`` record's ``image_tokens``), the
    epoch runs with every row once, and a micro-batch over the budget runs as passes (the Qwen-VL cut)."""
    from swift_runs import decisions, indices_by_epoch, sample_trace
    arch, model = vl_model
    pack = {'length_batching': {'micro_batch_tokens': 300}, 'integration': {'record_samples': True}}
    logs, _ = _vl_run(model, arch, vl_rows, str(tmp_path / 'lazy'), pack, lazy_tokenize=True, max_steps=-1,
                      num_train_epochs=1)
    records = decisions(str(tmp_path / 'lazy'))
    [estimate] = [d for d in records if d['kind'] == 'length_estimate']
    assert estimate['values']['image_tokens'] > 0 and estimate['values']['image_rule']['factor'] == 28
    assert sorted(indices_by_epoch(sample_trace(str(tmp_path / 'lazy')))[0]) == list(range(28))
    assert logs and all(r['loss'] == r['loss'] for r in logs)  # finite, no run stopped


@pytest.mark.vl
@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.start_first
@needs_vl
@pytest.mark.parametrize('engine', ['ddp', 'fsdp2', pytest.param('zero2', marks=pytest.mark.slow)])  # CI time
def test_two_processes_balanced_vl_rows_with_passes_equal_one_process(engine, vl_rows, fixture_dir, tmp_path):
    """2 CPU processes, ``mode: balanced`` with ``pass_tokens`` over rows with images of 10 sizes (and text-only
    rows): every row once, and the weights equal one process's over the same micro-batches a step (1e-5) under DDP,
    FSDP2 and ZeRO-2 (where every pass communicates, the rank with fewer passes runs zero-weight ones: a row cut by
    the Qwen-VL kind)."""
    from engine_runs import assert_engine, assert_same_steps, assert_same_weights, reference, run_ranks
    from swift_runs import indices_by_epoch, read_jsonl, sample_trace
    if engine == 'zero2' and importlib.util.find_spec('deepspeed') is None:
        pytest.skip('deepspeed is not installed')
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_vl_model
    arch = 'qwen2_vl'  # one architecture (the cut is the same for both; the single-process splits run both)
    model = str(build_tiny_vl_model(fixture_dir / f'tiny-{arch}', arch))
    pack = {'integration': {'record_samples': True}, 'length_batching': {'mode': 'balanced', 'pass_tokens': 240}}
    common = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=4, arch=arch)
    out = run_ranks(str(tmp_path / engine), model, vl_rows, engine=engine, callbacks=['length_batching'], pack=pack,
                    **common)
    t0, t1 = assert_engine(out, engine)
    assert_same_steps(t0, t1)
    seen = [i for rank in (0, 1) for i in indices_by_epoch(sample_trace(out, rank)).get(0, [])]
    assert sorted(seen) == list(range(28))  # 4 steps of 8 samples: the first epoch, every row once
    passes = sum(row['dynamic/passes_per_step'] for row in read_jsonl(os.path.join(out, 'logging.jsonl'))
                 if 'loss' in row)
    assert passes > 4 * 2  # several passes a step
    ref = reference(str(tmp_path / f'{engine}-ref'), model, vl_rows, out, gradient_accumulation_steps=2, max_steps=4,
                    arch=arch)
    assert_same_weights(out, ref)
