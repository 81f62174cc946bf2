"""Tiny random-weight vision-language models built offline: Qwen2-VL and Qwen2.5-VL on the Qwen2.5 tokenizer, and
Qwen3.5, Qwen3.5-MoE and Qwen3-VL on tokenizers derived from it whose special tokens sit where ms-swift's templates
expect them, and InternVL (transformers format) on the Qwen2.5 tokenizer with InternVL3's image tokens; each with a real
processor saved beside it. The text models and their tokenizers are :mod:`.tiny`'s.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from .tiny import (_NUM_HEADS, _NUM_KV_HEADS, _QWEN2_VOCAB_SIZE, _TOKENIZER_DIRS, materialize_tokenizer,
                   move_model_into_place)
from .tiny_data import _atomic_write

__all__ = ['VL_ARCHS', 'QWEN3_ARCHS', 'QWEN3_5_TOKEN_SHIFT', 'INTERNVL_TOKENS', 'build_tiny_vl_model',
           'build_tiny_qwen3_model', 'build_tiny_internvl_model',
           'materialize_qwen3_tokenizer']


VL_ARCHS: tuple[str, ...] = ('qwen2_vl', 'qwen2_5_vl')
"""Vision-language architectures accepted by :func:`build_tiny_vl_model`."""


def _built(dest: Path, arch: str) -> bool:
    """Whether ``dest`` holds a complete model of ``model_type`` ``arch`` (``config.json``, written last, and its
    weights), to be reused."""
    config_file = dest / 'config.json'
    if not (config_file.is_file() and (dest / 'model.safetensors').is_file()):
        return False
    try:
        return json.loads(config_file.read_text(encoding='utf-8')).get('model_type') == arch
    except ValueError:
        return False


def build_tiny_vl_model(dest: str | Path, arch: str = 'qwen2_vl', *, seed: int = 0,
                        max_pixels: int = 224 * 224) -> Path:
    """Builds and saves a tiny random-weight Qwen2-VL or Qwen2.5-VL with the real Qwen2.5 tokenizer and a real
    processor (patch 14, merge 2, temporal patch 2; images resized within ``max_pixels``).

    The language model is the tiny Qwen2's shape (hidden 64, 2 layers, 4 heads, 2 key/value heads, the Qwen2.5
    vocabulary, 3-D rotary sections ``[2, 3, 3]``); the vision tower has 2 blocks (Qwen2-VL: width 32; Qwen2.5-VL: width
    32, windows of 112 pixels, the last block full attention) and merges 2 x 2 patches into one image token. Weights
    depend only on ``seed``; the global torch RNG state is left as it was. An existing complete model is reused.

    Args:
        dest: Target directory; created if missing.
        arch: ``'qwen2_vl'`` or ``'qwen2_5_vl'`` (:data:`VL_ARCHS`).
        seed: Seed for the weight initialisation.
        max_pixels: The image processor's ``max_pixels``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path` (``--model_type`` / ``--template``: :data:`MODEL_FLAGS`).

    Raises:
        ValueError: If ``arch`` is not one of :data:`VL_ARCHS`.
    """
    if arch not in VL_ARCHS:
        raise ValueError(f'arch must be one of {list(VL_ARCHS)}, got arch={arch!r}')
    dest = Path(dest)
    if _built(dest, arch):
        return dest
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        materialize_tokenizer(tmp, 'qwen2')
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        text = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=_NUM_HEADS,
                    num_key_value_heads=_NUM_KV_HEADS, vocab_size=_QWEN2_VOCAB_SIZE, max_position_embeddings=4096,
                    rope_parameters={'rope_type': 'default', 'mrope_section': [2, 3, 3], 'rope_theta': 1e6},
                    eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'), pad_token_id=tokenizer.pad_token_id,
                    dtype='float32')
        tokens = dict(image_token_id=tokenizer.convert_tokens_to_ids('<|image_pad|>'),
                      video_token_id=tokenizer.convert_tokens_to_ids('<|video_pad|>'),
                      vision_start_token_id=tokenizer.convert_tokens_to_ids('<|vision_start|>'),
                      vision_end_token_id=tokenizer.convert_tokens_to_ids('<|vision_end|>'), tie_word_embeddings=True)
        if arch == 'qwen2_vl':
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2)
            config, model_cls = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens), \
                Qwen2VLForConditionalGeneration
        else:
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          fullatt_block_indexes=[1])
            config, model_cls = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens), \
                Qwen2_5_VLForConditionalGeneration
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(torch.float32).eval()
        model.save_pretrained(tmp)
        pixels = dict(min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
        parts: dict[str, Any] = dict(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer)
        try:  # transformers 5 processors take a video processor too
            from transformers import Qwen2VLVideoProcessor
            parts['video_processor'] = Qwen2VLVideoProcessor(**pixels)
        except ImportError:  # pragma: no cover - older transformers
            pass
        Qwen2VLProcessor(**parts).save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest


QWEN3_ARCHS: tuple[str, ...] = ('qwen3_5', 'qwen3_5_moe', 'qwen3_vl')
"""Architectures accepted by :func:`build_tiny_qwen3_model` (Qwen3.5, Qwen3.5-MoE, Qwen3-VL)."""

QWEN3_5_TOKEN_SHIFT: int = 96401
"""How far Qwen3.5's added tokens sit above Qwen2.5's: ``<|endoftext|>`` 151643 -> 248044, ``<|image_pad|>`` 151655 ->
248056 (the ids ms-swift's ``Qwen3_5Template`` hard-codes)."""

#: the four added tokens Qwen3 appended to Qwen2.5's 22 (ids 151665-151668; Qwen3.5: 248066-248069)
_QWEN3_EXTRA_TOKENS: tuple[str, ...] = ('<tool_response>', '</tool_response>', '<think>', '</think>')
_QWEN3_5_VOCAB_SIZE = 248320  # real Qwen3.5 embedding rows
_QWEN3_TOKENIZER_FAMILIES: tuple[str, ...] = ('qwen3', 'qwen3_5')


def materialize_qwen3_tokenizer(dest: str | Path, family: str = 'qwen3_5') -> Path:
    """Writes a Qwen3 or Qwen3.5 tokenizer derived from the vendored Qwen2.5 one into a directory.

    Both keep Qwen2.5's byte-level BPE (151,643 tokens, its merges, "Hello world" -> ``[9707, 1879]``) and its 22 added
    tokens, and append Qwen3's four added tokens ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``
    (not special, as ``<tool_call>``). ``qwen3``: the added tokens at Qwen3's ids 151643-151668 (``<|image_pad|>`` =
    151655, the tokenizer of Qwen3 and Qwen3-VL). ``qwen3_5``: every added token moved up by
    :data:`QWEN3_5_TOKEN_SHIFT` to Qwen3.5's ids 248044-248069 (``<|endoftext|>`` = 248044 pad, ``<|im_start|>`` =
    248045, ``<|im_end|>`` = 248046 eos, ``<|vision_start|>`` / ``<|vision_end|>`` = 248053 / 248054,
    ``<|image_pad|>`` / ``<|video_pad|>`` = 248056 / 248057, ``<think>`` / ``</think>`` = 248068 / 248069). Qwen3.5's
    real BPE is larger (248,044 tokens); ids 151643-248043 stay unused here.

    ``tokenizers`` gives an added token that is not in the BPE vocabulary the next free id whatever id the file names,
    so the shifted tokens are also written into the BPE vocabulary at their ids (no merge produces them). Hence
    ``len(tokenizer)`` is 151,669 for both families, below the largest id + 1 for ``qwen3_5``: size embeddings by the
    ids, not by ``len``. ``tokenizer_config.json`` is the vendored Qwen2.5 one (its ChatML chat template included;
    ms-swift's own templates do not use it) with ``added_tokens_decoder`` rewritten. Files that already hold the
    expected content are left untouched.

    Args:
        dest: Target directory; created if missing.
        family: ``'qwen3'`` or ``'qwen3_5'``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`, loadable with ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: If ``family`` is not ``'qwen3'`` or ``'qwen3_5'``.
    """
    if family not in _QWEN3_TOKENIZER_FAMILIES:
        raise ValueError(f'family must be one of {list(_QWEN3_TOKENIZER_FAMILIES)}, got family={family!r}')
    shift = QWEN3_5_TOKEN_SHIFT if family == 'qwen3_5' else 0
    source = _TOKENIZER_DIRS['qwen2']
    with gzip.open(source / 'tokenizer.json.gz', 'rt', encoding='utf-8') as f:
        tokenizer_json: dict[str, Any] = json.load(f)
    added: list[dict[str, Any]] = tokenizer_json['added_tokens']
    template = next(token for token in added if token['content'] == '<tool_call>')
    for content in _QWEN3_EXTRA_TOKENS:
        added.append({**template, 'id': added[-1]['id'] + 1, 'content': content})
    if shift:
        vocab: dict[str, int] = tokenizer_json['model']['vocab']
        for token in added:
            token['id'] += shift
            vocab[token['content']] = token['id']
    config: dict[str, Any] = json.loads((source / 'tokenizer_config.json').read_text(encoding='utf-8'))
    fields = ('content', 'lstrip', 'normalized', 'rstrip', 'single_word', 'special')
    config['added_tokens_decoder'] = {str(token['id']): {k: token[k] for k in fields} for token in added}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in (('tokenizer.json', json.dumps(tokenizer_json, ensure_ascii=False)),
                          ('tokenizer_config.json', json.dumps(config, ensure_ascii=False, indent=2) + '\n')):
        data, target = content.encode('utf-8'), dest / name
        if not target.is_file() or target.stat().st_size != len(data) or target.read_bytes() != data:
            _atomic_write(target, data)
    return dest


def build_tiny_qwen3_model(dest: str | Path, arch: str = 'qwen3_5', *, seed: int = 0,
                           max_pixels: int = 224 * 224) -> Path:
    """Builds and saves a tiny random-weight Qwen3.5, Qwen3.5-MoE or Qwen3-VL (``*ForConditionalGeneration``: a
    language model with a vision tower) with a real processor (image processor, video processor and tokenizer).

    Language model: hidden 64, 2 decoder layers, 4 attention heads and 2 key/value heads, tied embeddings, 3-D
    interleaved rotary positions.

    - ``qwen3_5`` (``Qwen3_5ForConditionalGeneration``): ``layer_types`` ``[linear_attention, full_attention]`` -- the
      first layer a Gated DeltaNet (linear attention: 2 key heads and 4 value heads of 16, causal convolution of
      width 4), the second gated full attention (head dim 32, rotary on a quarter of it, sections ``[2, 1, 1]``);
      MLP width 256; the Qwen3.5 vocabulary size 248320 with the Qwen3.5 token ids of
      :func:`materialize_qwen3_tokenizer` (``<|image_pad|>`` = 248056, the id ms-swift's ``Qwen3_5Template``
      hard-codes).
    - ``qwen3_5_moe`` (``Qwen3_5MoeForConditionalGeneration``): the same, with a sparse MLP in each layer: 4 experts of
      width 32, top-2 routing, and a gated shared expert of width 32. ``router_aux_loss_coef`` is left at the config's
      default (0.001) and ``output_router_logits`` at False; ms-swift overwrites the coefficient with its
      ``--router_aux_loss_coef`` (default 0: no auxiliary loss, the loss is the language-model loss alone).
    - ``qwen3_vl`` (``Qwen3VLForConditionalGeneration``): full attention in both layers (head dim 16, sections
      ``[4, 2, 2]``), MLP width 256, the Qwen3 tokenizer and vocabulary size 151936 (``<|image_pad|>`` = 151655);
      deepstack: the features after vision blocks 0 and 1 are merged and added to the hidden states of decoder layers
      0 and 1 at the image tokens.

    Vision tower (all three): 2 blocks of width 32 (2 heads, MLP 64), patch 16, 2 x 2 patches merged into one
    64-wide token (so a 32 x 32 pixel area is one image token), temporal patch 2, learned position embeddings
    interpolated over a 48 x 48 grid. The image processor resizes within ``max_pixels``, the video processor keeps
    Qwen3-VL's default frame budget; ms-swift's templates resize images and frames themselves (``qwen_vl_utils``,
    patch 16) and call them with ``do_resize=False``. Image and video processors normalise with mean and std 0.5.

    Weights are float32 and depend only on ``seed``; the global torch RNG state is left as it was. The Gated DeltaNet
    runs transformers' torch fallbacks (``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``) where
    ``flash-linear-attention`` / ``causal-conv1d`` are not installed. An existing complete model of ``arch`` is reused.

    Args:
        dest: Target directory; created if missing.
        arch: ``'qwen3_5'``, ``'qwen3_5_moe'`` or ``'qwen3_vl'`` (:data:`QWEN3_ARCHS`).
        seed: Seed for the weight initialisation.
        max_pixels: The image processor's ``max_pixels``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path` (``--model_type`` / ``--template``: :data:`MODEL_FLAGS`).

    Raises:
        ValueError: If ``arch`` is not one of :data:`QWEN3_ARCHS`.
    """
    if arch not in QWEN3_ARCHS:
        raise ValueError(f'arch must be one of {list(QWEN3_ARCHS)}, got arch={arch!r}')
    dest = Path(dest)
    if _built(dest, arch):
        return dest
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        family = 'qwen3' if arch == 'qwen3_vl' else 'qwen3_5'
        materialize_qwen3_tokenizer(tmp, family)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
            ('image_token_id', '<|image_pad|>'), ('video_token_id', '<|video_pad|>'),
            ('vision_start_token_id', '<|vision_start|>'), ('vision_end_token_id', '<|vision_end|>'))}
        eos_id, pad_id = tokenizer.convert_tokens_to_ids('<|im_end|>'), tokenizer.pad_token_id
        text: dict[str, Any] = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=_NUM_HEADS, num_key_value_heads=_NUM_KV_HEADS,
                                    max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos_id,
                                    pad_token_id=pad_id, dtype='float32')
        vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
        if arch == 'qwen3_vl':
            text.update(vocab_size=_QWEN2_VOCAB_SIZE, head_dim=16,
                        rope_parameters={'rope_type': 'default', 'rope_theta': 5e6, 'mrope_section': [4, 2, 2],
                                         'mrope_interleaved': True})
            vision.update(deepstack_visual_indexes=[0, 1])
            config_cls, model_cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        else:
            text.update(vocab_size=_QWEN3_5_VOCAB_SIZE, head_dim=32,
                        layer_types=['linear_attention', 'full_attention'],
                        rope_parameters={'rope_type': 'default', 'rope_theta': 1e7, 'partial_rotary_factor': 0.25,
                                         'mrope_section': [2, 1, 1], 'mrope_interleaved': True},
                        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4)
            if arch == 'qwen3_5_moe':
                del text['intermediate_size']
                text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32)
                config_cls, model_cls = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
            else:
                config_cls, model_cls = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
        config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(torch.float32).eval()
        model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                                                   do_sample=False)
        model.save_pretrained(tmp)
        patches = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=max_pixels, **patches),
                         video_processor=Qwen3VLVideoProcessor(**patches), tokenizer=tokenizer).save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest


#: InternVL3's image tokens after the Qwen2.5 tokenizer's 22 added ones (ids 151665-151668, as in InternVL3-1B-hf), by
#: the names its processor reads from the tokenizer (``tokenizer.context_image_token`` ...)
INTERNVL_TOKENS: dict[str, str] = {'start_image_token': '<img>', 'end_image_token': '</img>',
                                   'context_image_token': '<IMG_CONTEXT>', 'video_token': '<video>'}


def build_tiny_internvl_model(dest: str | Path, *, seed: int = 0, tile: int = 56, max_patches: int = 4) -> Path:
    """Builds and saves a tiny random-weight InternVL in the transformers format (``InternVLForConditionalGeneration``,
    ms-swift's ``model_type: internvl`` / ``template: internvl_hf``, as InternVL3-1B-hf) with a real processor.

    Language model: a Qwen2 of the tiny Qwen2's shape (hidden 64, 2 layers, 4 heads, 2 key/value heads, the Qwen2.5
    vocabulary and tokenizer with :data:`INTERNVL_TOKENS` added: ``<IMG_CONTEXT>`` = 151667). Vision tower (InternViT):
    2 blocks of width 32, MLP 64, ``tile``-pixel tiles of 14-pixel patches (``(tile / 14)^2`` patches and a class
    token), a pixel shuffle of ``downsample_ratio`` 0.5 and a two-layer projector: ``(tile / 28)^2`` image tokens a
    tile (4 at 56). The image processor (``GotOcr2ImageProcessor``) crops an image into 1 to ``max_patches`` tiles by
    its aspect ratio plus a thumbnail tile when there are several; a video frame is one tile. Weights depend only on
    ``seed``; the global torch RNG state is left as it was. An existing complete model is reused.

    Returns:
        ``dest`` as a :class:`~pathlib.Path` (``--model_type`` / ``--template``: ``MODEL_FLAGS['internvl']``).
    """
    dest = Path(dest)
    if _built(dest, 'internvl'):
        return dest
    from transformers import (GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration,
                              InternVLProcessor, InternVLVideoProcessor)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        materialize_tokenizer(tmp, 'qwen2')
        tokenizer = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=dict(INTERNVL_TOKENS))
        tokenizer.add_tokens(list(INTERNVL_TOKENS.values()), special_tokens=True)
        text = dict(model_type='qwen2', hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=_NUM_HEADS, num_key_value_heads=_NUM_KV_HEADS, vocab_size=_QWEN2_VOCAB_SIZE,
                    max_position_embeddings=4096, eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'),
                    pad_token_id=tokenizer.pad_token_id, dtype='float32')
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=[tile, tile], patch_size=[14, 14], use_mask_token=False)
        config = InternVLConfig(vision_config=vision, text_config=text,
                                image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS['context_image_token']),
                                downsample_ratio=0.5, projector_hidden_act='gelu', vision_feature_layer=-1,
                                vision_feature_select_strategy='default')
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = InternVLForConditionalGeneration(config).to(torch.float32).eval()
        model.save_pretrained(tmp)
        size = {'height': tile, 'width': tile}
        processor = InternVLProcessor(
            image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=False, min_patches=1,
                                                  max_patches=max_patches),
            video_processor=InternVLVideoProcessor(size=size), tokenizer=tokenizer,
            image_seq_length=(tile // 28) ** 2)
        processor.save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest
