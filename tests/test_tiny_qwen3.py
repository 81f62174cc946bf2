"""Tiny Qwen3.5, Qwen3.5-MoE and Qwen3-VL fixtures: derived tokenizers, model shapes, real ``swift sft`` runs.

Tokenizer layer (any environment): the Qwen3.5 tokenizer derived from the vendored Qwen2.5 one puts every added token
96401 ids up (``<|image_pad|>`` = 248056, the id ms-swift's ``Qwen3_5Template`` hard-codes), the Qwen3 one keeps
Qwen2.5's ids and adds ``<think>`` & co. at 151665-151668, both encode and decode text and chat tokens unchanged, and
a saved copy keeps the ids. Model layer (``vl``: the video processor needs torchvision): the documented shapes (the
first Qwen3.5 decoder layer a Gated DeltaNet) and a seeded build that leaves the global RNG alone. End to end (``vl``,
``e2e``: ms-swift's Qwen3-VL / Qwen3.5 templates need ``qwen-vl-utils``): a 2-step LoRA ``swift sft`` of each model
on text rows and on image rows, with finite losses and the micro-batch keys ms-swift's collator gives.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS
from swift_dynamic_callbacks.testing.tiny_vl import QWEN3_5_TOKEN_SHIFT, QWEN3_ARCHS, materialize_qwen3_tokenizer

VL_READY = all(importlib.util.find_spec(m) is not None for m in ('qwen_vl_utils', 'torchvision'))
needs_vl = pytest.mark.skipif(not VL_READY, reason='qwen-vl-utils / torchvision are not installed (scripts/test_vl.sh)')

#: Qwen2.5's 22 added tokens and Qwen3's 4, in id order from 151643
ADDED = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|object_ref_start|>', '<|object_ref_end|>', '<|box_start|>',
         '<|box_end|>', '<|quad_start|>', '<|quad_end|>', '<|vision_start|>', '<|vision_end|>', '<|vision_pad|>',
         '<|image_pad|>', '<|video_pad|>', '<tool_call>', '</tool_call>', '<|fim_prefix|>', '<|fim_middle|>',
         '<|fim_suffix|>', '<|fim_pad|>', '<|repo_name|>', '<|file_sep|>', '<tool_response>', '</tool_response>',
         '<think>', '</think>')
CHAT = ('<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|>'
        '<|vision_end|>How many pages?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"a": 1}\n'
        '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n')
TEXT = 'Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. Ünïcödé 数学 🙂'


# ---- tokenizers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('family, first', [('qwen3_5', 151643 + QWEN3_5_TOKEN_SHIFT), ('qwen3', 151643)])
def test_the_added_tokens_sit_at_the_familys_ids(family, first, tmp_path):
    """Every added token at ``first + i`` (Qwen3.5: ``<|endoftext|>`` 248044 ... ``<|image_pad|>`` 248056,
    ``<|video_pad|>`` 248057, ``</think>`` 248069; Qwen3: 151643 ... 151668), each a single id when encoded, the BPE
    (151643 tokens, "Hello world" -> 9707 1879) and the special tokens' roles (eos ``<|im_end|>``, pad
    ``<|endoftext|>``, no bos) unchanged."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(materialize_qwen3_tokenizer(tmp_path, family))
    assert [tokenizer.convert_tokens_to_ids(t) for t in ADDED] == list(range(first, first + len(ADDED)))
    assert [tokenizer.encode(t) for t in ADDED] == [[first + i] for i in range(len(ADDED))]
    assert tokenizer.convert_tokens_to_ids('<|image_pad|>') == (248056 if family == 'qwen3_5' else 151655)
    assert tokenizer.convert_tokens_to_ids('<|video_pad|>') == (248057 if family == 'qwen3_5' else 151656)
    assert tokenizer.encode('Hello world') == [9707, 1879]
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ('<|im_end|>', first + 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ('<|endoftext|>', first)
    assert tokenizer.bos_token is None
    assert len(tokenizer) == 151643 + len(ADDED)  # the BPE and the added tokens; the Qwen3.5 ids leave a gap
    assert max(tokenizer.get_vocab().values()) == first + len(ADDED) - 1


def test_text_and_chat_tokens_round_trip(tmp_path):
    """Plain text (accents, CJK, an emoji) and a ChatML conversation with vision, thinking and tool tokens decode back
    to the same string under both families; the text's ids are the Qwen2.5 tokenizer's, and the chat's Qwen3.5 ids are
    its Qwen3 ids with the added tokens moved up by 96401."""
    from transformers import AutoTokenizer

    from swift_dynamic_callbacks.testing.tiny import materialize_tokenizer
    qwen2 = AutoTokenizer.from_pretrained(materialize_tokenizer(tmp_path / 'qwen2', 'qwen2'))
    ids = {}
    for family in ('qwen3', 'qwen3_5'):
        tokenizer = AutoTokenizer.from_pretrained(materialize_qwen3_tokenizer(tmp_path / family, family))
        assert tokenizer.encode(TEXT) == qwen2.encode(TEXT)
        assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
        ids[family] = tokenizer.encode(CHAT)
        assert tokenizer.decode(ids[family]) == CHAT
        assert tokenizer.decode(ids[family], skip_special_tokens=True).startswith('system\nYou are helpful.\nuser\n')
    assert sum(i >= 151643 for i in ids['qwen3']) == 18
    assert ids['qwen3_5'] == [i + QWEN3_5_TOKEN_SHIFT if i >= 151643 else i for i in ids['qwen3']]


def test_a_saved_qwen3_5_tokenizer_keeps_its_ids(tmp_path):
    """``save_pretrained`` (ms-swift saves the tokenizer into each checkpoint) writes a tokenizer that loads with the
    same ids, also as the ``Qwen3_5Tokenizer`` class transformers picks for a ``qwen3_5`` model directory."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer
    tokenizer = AutoTokenizer.from_pretrained(materialize_qwen3_tokenizer(tmp_path / 'a', 'qwen3_5'))
    tokenizer.save_pretrained(tmp_path / 'b')
    for again in (AutoTokenizer.from_pretrained(tmp_path / 'b'), Qwen3_5Tokenizer.from_pretrained(tmp_path / 'b')):
        assert [again.convert_tokens_to_ids(t) for t in ADDED] == [tokenizer.convert_tokens_to_ids(t) for t in ADDED]
        assert again.encode(CHAT) == tokenizer.encode(CHAT)


def test_an_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="family must be one of .*'qwen2'"):
        materialize_qwen3_tokenizer(tmp_path, 'qwen2')


# ---- models -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module', params=list(QWEN3_ARCHS))
def qwen3_model(request, fixture_dir):
    if not VL_READY:
        pytest.skip('qwen-vl-utils / torchvision are not installed (scripts/test_vl.sh)')
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_qwen3_model
    return request.param, str(build_tiny_qwen3_model(fixture_dir / f'tiny-{request.param}', request.param))


@pytest.mark.vl
@needs_vl
def test_the_models_have_the_documented_shapes(qwen3_model):
    """Hidden 64, 2 layers, tied float32 weights; Qwen3.5 (and -MoE) layer 0 a Gated DeltaNet and layer 1 full
    attention, the MoE 4 experts top-2 plus a shared expert; Qwen3-VL deepstack after vision blocks 0 and 1; the vision
    tower 2 blocks, patch 16, merge 2; the model directory's tokenizer and processor give the config's token ids."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
    arch, path = qwen3_model
    model = AutoModelForImageTextToText.from_pretrained(path)
    config, text, vision = model.config, model.config.text_config, model.config.vision_config
    assert config.model_type == arch and type(model).__name__ == {
        'qwen3_5': 'Qwen3_5ForConditionalGeneration', 'qwen3_5_moe': 'Qwen3_5MoeForConditionalGeneration',
        'qwen3_vl': 'Qwen3VLForConditionalGeneration'}[arch]
    shape = (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads)
    assert shape == (64, 2, 4, 2)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.patch_size, vision.spatial_merge_size,
            vision.temporal_patch_size) == (2, 32, 64, 16, 2, 2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied
    layers = model.model.language_model.layers
    if arch == 'qwen3_vl':
        assert text.vocab_size == 151936 and vision.deepstack_visual_indexes == [0, 1]
        assert len(model.model.visual.deepstack_merger_list) == 2
    else:
        assert text.vocab_size == 248320
        assert text.layer_types == ['linear_attention', 'full_attention']
        assert type(layers[0].linear_attn).__name__.endswith('GatedDeltaNet') and not hasattr(layers[0], 'self_attn')
        assert hasattr(layers[1], 'self_attn') and not hasattr(layers[1], 'linear_attn')
        net = layers[0].linear_attn
        assert (net.num_k_heads, net.num_v_heads, net.head_k_dim, net.head_v_dim) == (2, 4, 16, 16)
    if arch == 'qwen3_5_moe':
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (4, 2, 32)
        assert text.router_aux_loss_coef == 0.001 and text.output_router_logits is False
        assert layers[0].mlp.experts.gate_up_proj.shape[0] == 4 and hasattr(layers[0].mlp, 'shared_expert')
    tokenizer, processor = AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path)
    assert type(tokenizer).__name__ == ('Qwen2Tokenizer' if arch == 'qwen3_vl' else 'Qwen3_5Tokenizer')
    for name, token in (('image_token_id', '<|image_pad|>'), ('video_token_id', '<|video_pad|>'),
                        ('vision_start_token_id', '<|vision_start|>'), ('vision_end_token_id', '<|vision_end|>')):
        assert getattr(config, name) == tokenizer.convert_tokens_to_ids(token) < text.vocab_size, name
    assert config.image_token_id == (248056 if arch != 'qwen3_vl' else 151655)
    assert text.eos_token_id == tokenizer.eos_token_id and text.pad_token_id == tokenizer.pad_token_id
    assert processor.image_token_id == config.image_token_id and processor.video_token_id == config.video_token_id
    assert processor.image_processor.patch_size == processor.video_processor.patch_size == 16
    assert processor.image_processor.merge_size == processor.video_processor.merge_size == 2


@pytest.mark.vl
@needs_vl
def test_the_build_is_seeded_reused_and_leaves_the_rng_alone(fixture_dir, tmp_path):
    """The same seed gives the same weights file, another seed other weights; a complete model is reused as it is; the
    global torch RNG state is the same after a build as before."""
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_qwen3_model
    first = build_tiny_qwen3_model(fixture_dir / 'tiny-qwen3_5', 'qwen3_5')
    stamp = (first / 'model.safetensors').stat().st_mtime_ns
    assert build_tiny_qwen3_model(first, 'qwen3_5') == first
    assert (first / 'model.safetensors').stat().st_mtime_ns == stamp
    state = torch.random.get_rng_state()
    again = build_tiny_qwen3_model(tmp_path / 'again', 'qwen3_5')
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (again / 'model.safetensors').read_bytes() == (first / 'model.safetensors').read_bytes()
    other = build_tiny_qwen3_model(tmp_path / 'other', 'qwen3_5', seed=1)
    assert (other / 'model.safetensors').read_bytes() != (first / 'model.safetensors').read_bytes()
    with pytest.raises(ValueError, match='arch must be one of'):
        build_tiny_qwen3_model(tmp_path / 'bad', 'qwen3')


def test_the_new_archs_have_ms_swift_flags():
    assert {a: MODEL_FLAGS[a] for a in QWEN3_ARCHS} == {
        'qwen3_5': {'model_type': 'qwen3_5', 'template': 'qwen3_5'},
        'qwen3_5_moe': {'model_type': 'qwen3_5_moe', 'template': 'qwen3_5'},
        'qwen3_vl': {'model_type': 'qwen3_vl', 'template': 'qwen3_vl'}}


# ---- end to end ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def qwen3_rows(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset, write_image_dataset
    return {'text': str(write_gsm8k_dataset(fixture_dir / 'qwen3' / 'text.jsonl', 4)),
            'image': str(write_image_dataset(fixture_dir / 'qwen3' / 'image.jsonl', 4, text_every=0))}


@pytest.mark.vl
@pytest.mark.e2e
@needs_vl
@pytest.mark.slow  # CI time: tests/test_qwen3_5.py trains every arch on image rows (and Qwen3.5 on text rows)
@pytest.mark.parametrize('rows', ['text', 'image'])
def test_two_lora_steps_train_with_finite_losses(qwen3_model, qwen3_rows, rows, tmp_path, monkeypatch):
    """``swift sft`` LoRA, 2 steps of 2 rows: finite losses near ``ln(vocab_size)`` (a random model) and finite,
    positive gradient norms. Each micro-batch ms-swift's collator gives holds ``input_ids``, ``labels``,
    ``attention_mask``, ``mm_token_type_ids`` ``[B, L]``, ``position_ids`` ``[3, B, L]`` and ``text_position_ids``
    ``[B, L]`` and nothing else (B = 2: the one-row packing keys ``cu_seq_lens_*`` / ``max_length_*`` are absent);
    image rows add ``pixel_values`` (one row a patch: ``sum(t * h * w)`` rows of 3 * 2 * 16 * 16 = 1536)
    and ``image_grid_thw`` ``[images, 3]``, with ``h * w / 4`` image tokens an image."""
    from swift.pipelines.train.sft import SwiftSft

    from swift_runs import run_sft, train_logs
    arch, model = qwen3_model
    batches: list[dict] = []
    train = SwiftSft.train

    def recording_train(self, trainer):
        collate = trainer.data_collator

        def record(features):
            batch = collate(features)
            batches.append(dict(batch))
            return batch

        trainer.data_collator = record
        return train(self, trainer)

    monkeypatch.setattr(SwiftSft, 'train', recording_train)
    out = run_sft(model, arch, qwen3_rows[rows], str(tmp_path / 'out'), max_steps=2)
    logs = train_logs(out)
    assert len(logs) == 2
    vocab = json.loads((Path(model) / 'config.json').read_text(encoding='utf-8'))['text_config']['vocab_size']
    for row in logs:
        assert math.isfinite(row['loss']) and abs(row['loss'] - math.log(vocab)) < 1.0, row
        assert math.isfinite(row['grad_norm']) and row['grad_norm'] > 0, row
    assert len(batches) >= 2
    image_token = 248056 if arch != 'qwen3_vl' else 151655
    text_keys = {'input_ids', 'labels', 'attention_mask', 'mm_token_type_ids', 'position_ids', 'text_position_ids'}
    for batch in batches[:2]:
        assert set(batch) == text_keys | ({'pixel_values', 'image_grid_thw'} if rows == 'image' else set())
        size, length = batch['input_ids'].shape
        assert size == 2
        for key in ('labels', 'attention_mask', 'mm_token_type_ids', 'text_position_ids'):
            assert batch[key].shape == (2, length), key
        assert batch['position_ids'].shape == (3, 2, length)
        if rows == 'text':
            assert int((batch['mm_token_type_ids'] != 0).sum()) == 0
            continue
        grid = batch['image_grid_thw']
        assert grid.shape == (2, 3) and batch['pixel_values'].shape == (int(grid.prod(-1).sum()), 1536)
        assert int((batch['input_ids'] == image_token).sum()) == int(grid.prod(-1).sum()) // 4
        assert int((batch['mm_token_type_ids'] == 1).sum()) == int(grid.prod(-1).sum()) // 4
