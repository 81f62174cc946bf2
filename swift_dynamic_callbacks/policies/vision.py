"""How many tokens an image becomes in a Qwen-VL row, from its size alone (pure: no image is decoded).

ms-swift resizes an image twice before the processor cuts it into patches (``template/base.py``
``_preprocess_inputs``, then ``qwen_vl_utils.fetch_image``):

1. the template's ``max_pixels`` (``--max_pixels``), when set: an image above it is scaled to it, keeping its aspect
   ratio (``vision_utils.rescale_image``: ``h = int(sqrt(max / ratio))``, ``w = int(h * ratio)``);
2. ``qwen_vl_utils.smart_resize``: both sides rounded to a multiple of ``factor`` (patch x merge: 28 for Qwen2 /
   Qwen2.5-VL, 32 for Qwen3-VL), the area brought within ``[min_pixels, max_pixels]`` (``MIN_PIXELS`` /
   ``MAX_PIXELS``, or ``IMAGE_MIN_TOKEN_NUM`` / ``IMAGE_MAX_TOKEN_NUM`` x ``factor^2``, as ms-swift sets them from
   the environment).

The image is then ``(h / factor) x (w / factor)`` tokens in its row (each of ``merge^2`` patches through the vision
tower). :class:`ResizeRule` holds the numbers a run trains with; :func:`image_tokens` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ResizeRule:
    """The resize a run's images go through (module docstring).

    Attributes:
        factor: both sides become multiples of it (patch size x spatial merge).
        min_pixels, max_pixels: the area ``smart_resize`` keeps an image within.
        template_max_pixels: the template's ``max_pixels`` applied first (``None``: not set).
        merge: patches a token (``spatial_merge_size^2``): the vision tower's patches are ``merge x`` the tokens.
    """

    factor: int = 28
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 16384 * 28 * 28
    template_max_pixels: int | None = None
    merge: int = 4


def _round(x: float, factor: int) -> int:
    return round(x / factor) * factor


def resized(width: int, height: int, rule: ResizeRule) -> tuple[int, int]:
    """``(width, height)`` of an image of ``width x height`` pixels after both resizes of ``rule``."""
    if rule.template_max_pixels and width * height > rule.template_max_pixels:
        ratio = width / height
        height = int(math.sqrt(rule.template_max_pixels / ratio))
        width = int(height * ratio)
    f = rule.factor
    h, w = max(f, _round(height, f)), max(f, _round(width, f))
    if h * w > rule.max_pixels:
        beta = math.sqrt((height * width) / rule.max_pixels)
        h, w = math.floor(height / beta / f) * f, math.floor(width / beta / f) * f
    elif h * w < rule.min_pixels:
        beta = math.sqrt(rule.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return w, h


def image_tokens(width: int, height: int, rule: ResizeRule) -> int:
    """The tokens an image of ``width x height`` pixels becomes in its row under ``rule``."""
    w, h = resized(width, height, rule)
    return (w // rule.factor) * (h // rule.factor)
