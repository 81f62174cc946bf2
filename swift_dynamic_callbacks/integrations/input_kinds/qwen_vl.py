"""Qwen-VL rows (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the templates built on them): images and videos beside the text.

A collated Qwen-VL micro-batch of ``B`` rows (ms-swift's ``Qwen2VLTemplate._data_collator``):

- per row along dim 0: ``input_ids``, ``labels``, ``attention_mask``, ``loss_scale``, ``text_position_ids``,
  ``mm_token_type_ids`` (``[B, L]``);
- ``position_ids`` ``[3, B, L]``: the 3-D rotary positions, rows along dim 1;
- ``pixel_values`` ``[P, C]``: every image's patches, the rows' images in order; ``image_grid_thw`` ``[I, 3]``: one
  row an image (its patches are the product); likewise ``pixel_values_videos`` / ``video_grid_thw`` for videos and
  ``second_per_grid_ts`` (a list, one entry a video; Qwen2.5-VL);
- a one-row micro-batch only (``text_position_ids`` ``[1, L]``, transformers >= 4.53): ``cu_seq_lens_q/k`` and
  ``max_length_q/k``, the row's boundaries for flash attention's variable-length path
  (:data:`ONE_ROW_PACKING_KEYS`). A one-row micro-batch is never cut into rows, so they stay with it whole; a piece of
  several rows never holds them (ms-swift collates none for a batch of several rows).

Each image is ``prod(grid_thw) / merge_size^2`` image tokens in its row's ``input_ids``, so a row's images are the next
ones in order until its image tokens are accounted for. :meth:`QwenVL.prepare` counts them on the host at the step
boundary (:class:`VisionBatch`); :meth:`QwenVL.cut` then slices every key at those counts with host ints only. A piece
without images carries no ``pixel_values``: ms-swift runs a placeholder image through the vision tower with a zero
weight (``Template._get_inputs_embeds_hf``), so its gradient is the rows' own.
"""

from __future__ import annotations

from itertools import accumulate
from types import SimpleNamespace
from typing import Any, ClassVar, Mapping, Sequence

import torch

from ...config.models import QWEN_VL_TYPES  # noqa: F401 - re-exported by the package
from ...policies.vision import ResizeRule, VideoRule
from .base import InputKind, VisionBatch, _has_rows, batch_rows, row_patches


#: per row along dim 0
ROW_KEYS = ('input_ids', 'labels', 'attention_mask', 'attention_mask_2d', 'loss_scale', 'text_position_ids',
            'mm_token_type_ids', 'token_type_ids', 'channel', 'inputs_embeds')
#: images / videos: (values key, grid key, token id attribute of the model config)
MEDIA = (('pixel_values', 'image_grid_thw', 'image_token_id'), ('pixel_values_videos', 'video_grid_thw',
                                                                  'video_token_id'))
#: one entry a video (a list)
PER_VIDEO = ('second_per_grid_ts', )
#: what ms-swift's Qwen-VL collator adds to a one-row micro-batch (``get_packed_seq_params`` of its text positions)
ONE_ROW_PACKING_KEYS = ('cu_seq_lens_q', 'cu_seq_lens_k', 'max_length_q', 'max_length_k')


class QwenVL(InputKind):
    """Qwen-VL micro-batches (module docstring).

    Args:
        setting: how a refusal names the model (``model_type: qwen2_vl``).
        image_token_id, video_token_id: the placeholder tokens of an image / a video patch group in ``input_ids``.
        merge_size: the vision tower's spatial merge (tokens = patches / merge_size^2).
    """

    name: ClassVar[str] = 'qwen_vl'
    packs: ClassVar[bool] = False  # its rows' positions are 3-D: the pack's padding-free packing would redo them

    def __init__(self, setting: str = '', *, image_token_id: int = 151655, video_token_id: int = 151656,
                 merge_size: int = 2) -> None:
        super().__init__(setting)
        self.token_ids = {'image_token_id': int(image_token_id), 'video_token_id': int(video_token_id)}
        self.merge = int(merge_size) ** 2

    @classmethod
    def matches(cls, layout: str) -> bool:
        return layout == 'qwen_vl'

    @classmethod
    def for_model(cls, setting: str, config: Any) -> 'QwenVL':
        """The kind with the token ids and merge size of a model's ``config``."""
        vision = getattr(config, 'vision_config', None)
        return cls(setting, image_token_id=getattr(config, 'image_token_id', 151655),
                   video_token_id=getattr(config, 'video_token_id', 151656),
                   merge_size=getattr(vision, 'spatial_merge_size', 2))

    def refusal(self, batch: Mapping[str, Any]) -> str | None:
        if not _has_rows(batch):
            return 'a micro-batch without an input_ids or labels tensor cannot be cut into rows'
        rows = batch_rows(batch)
        known = set(ROW_KEYS) | {'position_ids'} | set(PER_VIDEO) | {k for media in MEDIA for k in media[:2]}
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if key in ONE_ROW_PACKING_KEYS and rows == 1:  # never cut: a one-row batch stays whole
                continue
            if key == 'position_ids':
                if not (value.dim() == 3 and value.shape[1] == rows) and not value.shape[0] == rows:
                    return f'micro-batch key position_ids of shape {tuple(value.shape)} is neither [3, B, L] nor [B, L]'
            elif key not in known and value.shape[0] != rows:
                return (f'micro-batch key {key!r} of shape {tuple(value.shape)} is not one a Qwen-VL input kind '
                        f'cuts ({self.setting or self.name}); known: {", ".join(sorted(known))}')
        return None

    def prepare(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping) or isinstance(batch, VisionBatch):
            return batch
        ids = batch.get('input_ids')
        row_media, patches = {}, {}
        for (values, grid, token), media in zip(MEDIA, ('image', 'video')):
            thw = batch.get(grid)
            if not isinstance(thw, torch.Tensor) or not isinstance(ids, torch.Tensor):
                continue
            sizes = [int(p) for p in thw.prod(dim=-1).tolist()]  # host tensors (the loader's): no device sync
            tokens = (ids == self.token_ids[token]).sum(dim=-1).tolist()
            row_media[media] = _rows_of(tokens, [s // self.merge for s in sizes], grid)
            patches[media] = sizes
        return VisionBatch(batch, row_media, patches)

    def cut(self, batch: Mapping[str, Any], bounds: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        if not isinstance(batch, VisionBatch):
            batch = self.prepare(batch)
        rows = batch_rows(batch)
        whole = list(bounds) == [(0, rows)]
        parts: list[dict[str, Any]] = [{} for _ in bounds]
        for key, value in batch.items():
            if key in ONE_ROW_PACKING_KEYS and not whole:  # a one-row batch's boundaries: not a piece's
                continue
            for part, (a, b) in zip(parts, bounds):
                part[key] = value if key in ONE_ROW_PACKING_KEYS else _row_slice(key, value, a, b, rows)
        for (values, grid, _), media in zip(MEDIA, ('image', 'video')):
            if media not in batch.row_media:
                continue
            per_row = batch.row_media[media]
            item_starts = [0, *accumulate(per_row)]
            patch_starts = [0, *accumulate(batch.patches[media])]
            for part, (a, b) in zip(parts, bounds):
                first, last = item_starts[a], item_starts[b]
                if first == last:  # no image (video) in these rows: ms-swift's placeholder pass
                    for key in (values, grid) + (PER_VIDEO if media == 'video' else ()):
                        part.pop(key, None)
                    continue
                part[grid] = batch[grid][first:last]
                if isinstance(batch.get(values), torch.Tensor):
                    part[values] = batch[values][patch_starts[first]:patch_starts[last]]
                for key in PER_VIDEO if media == 'video' else ():
                    if isinstance(batch.get(key), (list, tuple)):
                        part[key] = batch[key][first:last]
        return parts

    def image_rule(self, trainer: Any) -> ResizeRule:
        """The resize ms-swift's Qwen-VL template applies (:mod:`...policies.vision`), read from what the run
        trains with: the processor's patch size, ``qwen_vl_utils``' limits as ms-swift set them from the environment
        (``MAX_PIXELS``, ``MIN_PIXELS``, ...; imported only here, where the template has imported it already) and the
        template's ``max_pixels``; with the rule of its videos (:func:`video_rule`) for the templates whose videos it
        knows."""
        template = getattr(trainer, 'template', None)
        processor = getattr(getattr(template, 'processor', None), 'image_processor', None)
        patch = int(getattr(processor, 'patch_size', 14) or 14)
        try:
            from qwen_vl_utils import vision_process as limits
        except ImportError:  # the template could not have run without it; the defaults of qwen-vl-utils 0.0.14
            limits = None
        merge_side = int(getattr(limits, 'SPATIAL_MERGE_SIZE', round(self.merge ** 0.5)))
        factor = patch * merge_side
        if hasattr(limits, 'IMAGE_MAX_TOKEN_NUM'):
            low, high = limits.IMAGE_MIN_TOKEN_NUM * factor**2, limits.IMAGE_MAX_TOKEN_NUM * factor**2
        elif hasattr(limits, 'MAX_PIXELS'):  # qwen-vl-utils < 0.0.12
            low, high = limits.MIN_PIXELS, limits.MAX_PIXELS
        else:
            low, high = 4 * factor**2, 16384 * factor**2
        return ResizeRule(factor=factor, min_pixels=int(low), max_pixels=int(high),
                          template_max_pixels=getattr(template, 'max_pixels', None) or None, merge=self.merge,
                          video=video_rule(template, limits, merge_side=merge_side))

    def vision_patches(self, batch: Mapping[str, Any]) -> list[int] | None:
        return row_patches(batch)

    def media_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids.values())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), 'merge': self.merge, **self.token_ids}


#: the templates whose videos :func:`video_rule` knows (ms-swift's ``Qwen2VLTemplate.version``): Qwen2-VL / QVQ
#: (``v2``), Qwen2.5-VL / MiMo-VL (``v2_5``). Qwen3-VL (``v3``) is not: its processor adds a timestamp and the vision
#: start / end tokens to each temporal patch and samples frames itself.
VIDEO_TEMPLATES = ('v2', 'v2_5')
#: qwen-vl-utils 0.0.14's defaults (``vision_process``), where it cannot be imported
_VIDEO_DEFAULTS = {'VIDEO_MIN_TOKEN_NUM': 128, 'VIDEO_MAX_TOKEN_NUM': 768, 'IMAGE_MIN_TOKEN_NUM': 4,
                   'IMAGE_MAX_TOKEN_NUM': 16384, 'FPS': 2.0, 'FPS_MIN_FRAMES': 4, 'FPS_MAX_FRAMES': 768,
                   'FRAME_FACTOR': 2, 'MODEL_SEQ_LEN': 128000}


def video_rule(template: Any, limits: Any, *, merge_side: int = 2) -> VideoRule | None:
    """How ms-swift's Qwen-VL ``template`` turns a video into tokens (:class:`~...policies.vision.VideoRule`), from
    qwen-vl-utils' module ``limits`` (``qwen_vl_utils.vision_process``) as ms-swift set them from the environment:
    ``FPS``, ``FPS_MIN_FRAMES``, ``FPS_MAX_FRAMES``, ``FRAME_FACTOR``, ``VIDEO_MIN_TOKEN_NUM`` / ``VIDEO_MAX_TOKEN_NUM``
    (``VIDEO_MIN_PIXELS`` / ``VIDEO_MAX_PIXELS`` divided by 28^2), ``IMAGE_MIN_TOKEN_NUM`` / ``IMAGE_MAX_TOKEN_NUM``
    and ``MODEL_SEQ_LEN`` (read by qwen-vl-utils when imported).

    The template calls ``fetch_video`` without a patch size for these versions, so its factor is qwen-vl-utils'
    default patch (14) x ``merge_side``; the processor's ``temporal_patch_size`` merges frames.

    Returns:
        ``None`` (videos not counted): a template not of :data:`VIDEO_TEMPLATES`, or qwen-vl-utils before 0.0.14
        (no ``VIDEO_MAX_TOKEN_NUM``: its frame lists are resized otherwise).
    """
    if getattr(template, 'version', None) not in VIDEO_TEMPLATES:
        return None
    if limits is None:
        limits = SimpleNamespace(**_VIDEO_DEFAULTS)
    if not hasattr(limits, 'VIDEO_MAX_TOKEN_NUM'):
        return None
    get = lambda name: getattr(limits, name, _VIDEO_DEFAULTS[name])  # noqa: E731
    processor = getattr(template, 'processor', None)
    frames = getattr(processor, 'video_processor', None) or getattr(processor, 'image_processor', None)
    factor = 14 * merge_side
    list_factor = factor * merge_side  # qwen-vl-utils 0.0.14 passes its image factor as fetch_image's patch size
    return VideoRule(factor=factor, min_pixels=int(get('VIDEO_MIN_TOKEN_NUM') * factor**2),
                     max_pixels=int(get('VIDEO_MAX_TOKEN_NUM') * factor**2),
                     total_pixels=get('MODEL_SEQ_LEN') * factor**2 * 0.9, fps=float(get('FPS')),
                     min_frames=int(get('FPS_MIN_FRAMES')), max_frames=int(get('FPS_MAX_FRAMES')),
                     frame_factor=int(get('FRAME_FACTOR')),
                     temporal_patch=int(getattr(frames, 'temporal_patch_size', 2) or 2), list_factor=list_factor,
                     list_min_pixels=int(get('IMAGE_MIN_TOKEN_NUM') * list_factor**2),
                     list_max_pixels=int(get('IMAGE_MAX_TOKEN_NUM') * list_factor**2))


def _rows_of(tokens: Sequence[int], item_tokens: Sequence[int], grid: str) -> list[int]:
    """How many of the items (images or videos, of ``item_tokens`` tokens each, in order) each row holds, from the
    rows' placeholder ``tokens``."""
    out, i = [], 0
    for need in tokens:
        n = 0
        while need > 0:
            if i >= len(item_tokens):
                raise ValueError(f'the rows hold more placeholder tokens than {grid} accounts for')
            need -= item_tokens[i]
            i, n = i + 1, n + 1
        if need < 0:
            raise ValueError(f'a row\'s placeholder tokens do not add up to whole items of {grid}')
        out.append(n)
    if i != len(item_tokens):
        raise ValueError(f'{grid} has {len(item_tokens)} items, the rows hold {i}')
    return out


def _row_slice(key: str, value: Any, a: int, b: int, rows: int) -> Any:
    """``value``'s rows ``a:b`` where it holds one entry a row (``position_ids`` ``[3, B, L]``: along dim 1); media
    keys and other values as they are (replaced by :meth:`QwenVL.cut`)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if key == 'position_ids' and value.dim() == 3 and value.shape[1] == rows:
            return value[:, a:b]
        if key in {m[0] for m in MEDIA} | {m[1] for m in MEDIA}:
            return value
        if value.shape[0] == rows:
            return value[a:b]
        raise ValueError(f'cannot cut micro-batch key {key!r} of shape {tuple(value.shape)} along {rows} rows '
                         '(QwenVL.refusal refuses it at the step boundary: a bug if it gets here)')
    if isinstance(value, (list, tuple)) and len(value) == rows and key not in PER_VIDEO:
        return value[a:b]
    return value
