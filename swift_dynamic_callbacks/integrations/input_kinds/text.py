"""Text rows: every tensor of a micro-batch holds one entry a row along dim 0 (``[B, L]`` ids, labels, masks and
positions; ``[B]`` values), so a piece of rows is the rows' slice of each."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch

from .base import InputKind, _has_rows, batch_rows

#: keys that hold something other than one entry a row in the multimodal families ms-swift collates (images,
#: patches, grids, audio features, per-image sizes and flags): never sliced as rows, even when their count happens
#: to equal the batch's rows
MEDIA_KEYS = ('pixel_values', 'pixel_values_videos', 'image_grid_thw', 'video_grid_thw', 'second_per_grid_ts',
              'image_sizes', 'image_flags', 'input_features', 'feature_attention_mask', 'aspect_ratio_ids',
              'aspect_ratio_mask', 'cross_attention_mask', 'images', 'videos', 'audios', 'image_bound',
              'num_patches', 'tgt_sizes', 'image_attention_mask', 'pixel_attention_mask')


class TextRows(InputKind):
    """A text model's micro-batches (the last kind asked: any model no other kind claims and whose template takes
    no media)."""

    name: ClassVar[str] = 'text'

    @classmethod
    def matches(cls, layout: str) -> bool:
        return layout == 'text'

    def refusal(self, batch: Mapping[str, Any]) -> str | None:
        if not _has_rows(batch):
            return 'a micro-batch without an input_ids or labels tensor cannot be cut into rows'
        rows = batch_rows(batch)
        for key, value in batch.items():
            if key in MEDIA_KEYS and value is not None:
                return (f'micro-batch key {key!r} holds images or audio, not one entry a row, and no input kind of '
                        f'the pack cuts this model\'s micro-batches{_of(self.setting)}')
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != rows:
                return (f'micro-batch key {key!r} of shape {tuple(value.shape)} does not hold one entry a row of its '
                        f'{rows} rows, so it cannot be cut into passes{_of(self.setting)}')
        return None

    def cut(self, batch: Mapping[str, Any], bounds: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        rows = batch_rows(batch)
        parts: list[dict[str, Any]] = [{} for _ in bounds]
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape[0] != rows:  # refused at the boundary (refusal); a bug if it gets here
                    raise ValueError(f'cannot split micro-batch key {key!r} of shape {tuple(value.shape)} into pieces '
                                     f'along a batch of {rows}')
                for part, (a, b) in zip(parts, bounds):
                    part[key] = value[a:b]
            elif isinstance(value, (list, tuple)) and len(value) == rows:
                for part, (a, b) in zip(parts, bounds):
                    part[key] = value[a:b]
            else:
                for part in parts:
                    part[key] = value
        return parts


def _of(setting: str) -> str:
    return f' ({setting})' if setting else ''
