"""What a run's model is, decided from its config before it loads (no torch): the layout of its micro-batches (text
rows, Qwen-VL rows or tiled-image rows whose images the pack cuts at their rows, or another multimodal layout no input
kind cuts), whether it has linear-attention layers and whether it is a mixture of experts.

The rule reads the structure of the config, not a list of names, so a new model of a known layout is recognised
without a code change: a ``vision_config`` with ``spatial_merge_size`` and ``temporal_patch_size`` beside
``image_token_id`` / ``video_token_id`` is the Qwen-VL layout (every image's patches concatenated, one
``image_grid_thw`` row an image, 3-D rotary positions: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, ...); a
``vision_config`` with ``image_size`` and ``patch_size`` beside a ``downsample_ratio`` and an ``image_token_id`` is the
tiles layout (every image, and every video frame, a stack of equal square tiles, each a fixed number of image tokens:
InternVL's transformers format, InternVL3 / InternVL3.5 ``-hf``; :func:`tile_tokens_of`). ``swift-dynamic
check`` reads the model folder's ``config.json`` (:func:`model_facts`); the input kinds read the loaded model's config
with the same rule (:func:`layout_of`). Where no config can be read before the model loads (a hub id), the
``model_type`` and the id are looked up in the known names (:data:`QWEN_VL_TYPES`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

#: ms-swift model types whose templates collate Qwen-VL micro-batches (images / videos beside the text): the fallback
#: when no config can be read before the model loads
QWEN_VL_TYPES = ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe', 'qwen3_5', 'qwen3_5_moe', 'qvq', 'mimo_vl')

#: ms-swift model types whose templates collate tiles-layout micro-batches (``internvl``: InternVL3 / InternVL3.5 in the
#: transformers format, template ``internvl_hf``; ``internvl_chat`` is the remote-code format, another layout)
TILES_TYPES = ('internvl', )

#: hub ids of Qwen-VL models (Qwen3.5 is natively multimodal), for a YAML that names the model without ``model_type``
_QWEN_VL_ID = re.compile(r'(qwen[23](\.5)?-vl|qwen3\.[5-9]|qvq|mimo-vl)', re.IGNORECASE)

#: the layouts of a micro-batch (:func:`layout_of`)
LAYOUTS = ('text', 'qwen_vl', 'tiles', 'multimodal')

#: the layouts whose images an input kind cuts at their rows
VISION_LAYOUTS = ('qwen_vl', 'tiles')

#: config fields that count a mixture of experts' experts (any > 0: a MoE)
_EXPERT_FIELDS = ('num_experts', 'num_local_experts', 'n_routed_experts', 'moe_num_experts')


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _text(config: Any) -> Any:
    """The language model's part of a config (``text_config`` of a multimodal one), else the config itself."""
    text = _get(config, 'text_config')
    return text if text is not None else config


#: a config of the Qwen family (``model_type`` prefixes, architecture names): the Qwen-VL layout is only claimed for
#: them (another family with image grids, e.g. GLM-4.1V, interleaves its video frames otherwise)
_QWEN_FAMILY = re.compile(r'^(qwen|qvq|mimo)|Qwen', re.IGNORECASE)


def _towers(config: Any) -> tuple[Any, Any]:
    """``(vision_config, audio_config)`` of a config, or of its nested model part (Qwen-Omni's ``thinker_config``)."""
    vision, audio = _get(config, 'vision_config'), _get(config, 'audio_config')
    if vision is None and audio is None:
        for part in ('thinker_config', 'llm_config', 'language_config'):
            nested = _get(config, part)
            if nested is not None and (_get(nested, 'vision_config') is not None
                                       or _get(nested, 'audio_config') is not None):
                return _get(nested, 'vision_config'), _get(nested, 'audio_config') or 'nested'
    return vision, audio


def _side(value: Any) -> int | None:
    """A square size (``448`` or ``[448, 448]``) as one int, else ``None``."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return value if isinstance(value, int) and value > 0 else None


def tile_tokens_of(config: Any) -> int | None:
    """The image tokens of one tile of the tiles layout (module docstring): ``(image_size / patch_size)^2`` patches
    a tile, ``downsample_ratio^2`` of them a token after the pixel shuffle (InternVL's ``image_seq_length``: 256 for
    448-pixel tiles of 14-pixel patches at 0.5); ``None``: not that layout's config."""
    vision, audio = _towers(config)
    if vision is None or audio is not None or _get(config, 'image_token_id') is None:
        return None
    side, patch, ratio = _side(_get(vision, 'image_size')), _side(_get(vision, 'patch_size')), _get(config,
                                                                                                      'downsample_ratio')
    if side is None or patch is None or side % patch or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        return None
    tokens = (side // patch) ** 2 * ratio * ratio
    return int(tokens) if tokens == int(tokens) and tokens >= 1 else None


def tile_merge_of(config: Any) -> int:
    """The vision patches merged into one image token of the tiles layout (its pixel shuffle:
    ``1 / downsample_ratio^2``; 1 where the config gives no ratio)."""
    ratio = _get(config, 'downsample_ratio')
    return round(1 / ratio**2) if isinstance(ratio, (int, float)) and ratio > 0 else 1


def layout_of(config: Any) -> str:
    """The layout of a model's micro-batches from its config (a ``config.json`` mapping or a transformers config):
    ``qwen_vl`` (module docstring; a model of the Qwen family), ``tiles`` (:func:`tile_tokens_of`), ``multimodal`` (a
    vision or audio tower of another layout or family) or ``text``."""
    vision, audio = _towers(config)
    if vision is None and audio is None:
        return 'text'
    tokens = all(_get(config, k) is not None or _get(_text(config), k) is not None
                 for k in ('image_token_id', 'video_token_id'))
    grid = vision is not None and all(_get(vision, k) is not None
                                      for k in ('spatial_merge_size', 'temporal_patch_size'))
    names = [str(_get(config, 'model_type') or '')] + [str(a) for a in (_get(config, 'architectures') or ())]
    qwen = any(_QWEN_FAMILY.search(n) for n in names if n)
    if grid and tokens and audio is None and qwen:
        return 'qwen_vl'
    return 'tiles' if tile_tokens_of(config) is not None else 'multimodal'


def linear_attention_of(config: Any) -> bool:
    """Whether the language model has linear-attention layers (``layer_types`` holding ``linear_attention``: Qwen3.5,
    Qwen3-Next): each keeps a recurrent state per row, so packed rows need their boundaries passed to its kernels."""
    types = _get(_text(config), 'layer_types') or ()
    return any(str(t) == 'linear_attention' for t in types)


def moe_of(config: Any) -> bool:
    """Whether the language model is a mixture of experts (an expert count > 0)."""
    text = _text(config)
    return any(int(_get(text, k) or 0) > 0 for k in _EXPERT_FIELDS)


@dataclass(frozen=True)
class VisionShape:
    """What a vision tower's blocks are, for the pass cost model (:func:`~..policies.pass_cost.vision_bytes_per_token`).

    Attributes:
        width: a block's hidden width.
        intermediate: its MLP's width.
        depth: its blocks.
        gated: its MLP is gated (gate and up projections: Qwen2.5-VL), else two linear layers (Qwen2-VL, Qwen3-VL,
            Qwen3.5).
        merge: patches merged into one language-model token (``spatial_merge_size ** 2``; the tiles layout:
            ``1 / downsample_ratio ** 2``).
    """

    width: int
    intermediate: int
    depth: int
    gated: bool
    merge: int


def vision_shape_of(config: Any) -> VisionShape | None:
    """The vision tower's shape from a model's config (a ``config.json`` mapping or a transformers config), for the
    Qwen-VL and tiles layouts (:func:`layout_of`); ``None`` for another layout or a tower whose widths are not in its
    config. Qwen2-VL names its width ``embed_dim`` and its MLP ``mlp_ratio`` x it (its ``hidden_size`` is the language
    model's); the later ones ``hidden_size`` and ``intermediate_size``. A gated MLP: ``hidden_act`` ``silu``. The
    tiles layout (InternViT): ``num_hidden_layers`` blocks of a two-layer MLP, ``1 / downsample_ratio^2`` patches a
    token."""
    layout = layout_of(config)
    vision = _towers(config)[0]
    if layout == 'tiles':
        width, intermediate, depth = (_get(vision, k) for k in ('hidden_size', 'intermediate_size',
                                                                 'num_hidden_layers'))
        merge = tile_merge_of(config)
        if not all(isinstance(v, int) and v > 0 for v in (width, intermediate, depth)):
            return None
        return VisionShape(width=width, intermediate=intermediate, depth=depth, gated=False, merge=merge)
    if layout != 'qwen_vl':
        return None
    width = _get(vision, 'embed_dim') or _get(vision, 'hidden_size')
    ratio = _get(vision, 'mlp_ratio')
    intermediate = int(width * ratio) if ratio and _get(vision, 'embed_dim') else _get(vision, 'intermediate_size')
    depth, merge = _get(vision, 'depth'), _get(vision, 'spatial_merge_size')
    if not all(isinstance(v, int) and v > 0 for v in (width, intermediate, depth, merge)):
        return None
    return VisionShape(width=width, intermediate=intermediate, depth=depth,
                       gated=str(_get(vision, 'hidden_act') or '') == 'silu', merge=merge * merge)


@dataclass(frozen=True)
class ModelFacts:
    """What the pack knows of a run's model before it loads.

    Attributes:
        setting: how a message names the model (``model: <dir> (config.json)``, ``model_type: qwen3_5``, ...).
        model_type: the config's or the setting's model type (``None``: unknown).
        layout: :data:`LAYOUTS`, or ``None`` when nothing could be read or matched.
        linear_attention: :func:`linear_attention_of` (``False`` when unknown).
        moe: :func:`moe_of` (``None``: unknown).
        from_config: the facts come from the model's ``config.json`` (else from names).
    """

    setting: str = ''
    model_type: str | None = None
    layout: str | None = None
    linear_attention: bool = False
    moe: bool | None = None
    from_config: bool = False

    @property
    def qwen_vl(self) -> bool:
        return self.layout == 'qwen_vl'

    @property
    def vision_rows(self) -> bool:
        """Its rows carry images an input kind cuts at their rows (:data:`VISION_LAYOUTS`)."""
        return self.layout in VISION_LAYOUTS


def layout_by_name(model_type: str | None) -> str | None:
    """The layout known for an ms-swift ``model_type`` where no config can be read (:data:`QWEN_VL_TYPES`: Qwen-VL;
    :data:`TILES_TYPES`: tiles), else ``None``."""
    if model_type in QWEN_VL_TYPES:
        return 'qwen_vl'
    return 'tiles' if model_type in TILES_TYPES else None


def read_model_config(model: Any) -> dict[str, Any] | None:
    """The ``config.json`` of a local model folder (``None``: not a folder with one, or unreadable)."""
    if not isinstance(model, str) or not model:
        return None
    path = os.path.join(os.path.expanduser(model), 'config.json')
    try:
        with open(path, encoding='utf-8') as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_facts(settings: Mapping[str, Any]) -> ModelFacts:
    """The facts of the model ``settings`` name (``model``, ``model_type``): from its ``config.json`` when ``model``
    is a local folder, else from the known names (:data:`QWEN_VL_TYPES`, hub ids)."""
    model = settings.get('model')
    model_type = settings.get('model_type')
    config = read_model_config(model)
    if config is not None:
        return ModelFacts(setting=f'model: {model} (its config.json)',
                          model_type=model_type or config.get('model_type'), layout=layout_of(config),
                          linear_attention=linear_attention_of(config), moe=moe_of(config), from_config=True)
    if model_type:
        return ModelFacts(setting=f'model_type: {model_type}', model_type=model_type,
                          layout=layout_by_name(model_type))
    name = str(model or '').rsplit('/', 1)[-1]
    if _QWEN_VL_ID.search(name):
        return ModelFacts(setting=f'model: {model}', layout='qwen_vl')
    return ModelFacts(setting=f'model: {model}' if model else '')


def unsupported_why(setting: str) -> str:
    """Why a multimodal model of a layout no input kind cuts has its micro-batches never cut (OOM recovery off, pass
    settings refused), naming it (``setting``)."""
    return (f'{setting or "this model"} is a multimodal model whose micro-batches no input kind of the pack cuts (its '
            'images or audio are not one entry a row; cut: text rows; the Qwen-VL layout: a vision_config with '
            'spatial_merge_size and temporal_patch_size beside image_token_id / video_token_id, Qwen family; the tiles '
            'layout: a vision_config with image_size and patch_size beside downsample_ratio and image_token_id, '
            'InternVL -hf)')

