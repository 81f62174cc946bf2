"""Tiled-image rows (InternVL's transformers format: InternVL3 / InternVL3.5 ``-hf``, ms-swift's ``internvl_hf``
template): every image, and every video frame, a stack of equal square tiles beside the text.

A collated micro-batch of ``B`` rows (ms-swift's ``InternvlhfTemplate``, its base collator):

- per row along dim 0: ``input_ids``, ``labels``, ``attention_mask``, ``loss_scale``, ``position_ids`` (``[B, L]``);
- ``pixel_values`` ``[T, C, S, S]``: every tile of every row's images and video frames, the rows in order (an image
  is 1 to ``max_patches`` crops and a thumbnail; a video frame one tile).

Each tile is the same number of image-context tokens in its row's ``input_ids`` (``image_seq_length``:
:func:`...config.models.tile_tokens_of`), filled in order by the model's ``masked_scatter``, so a row's tiles are its
context tokens / the tokens of a tile, contiguous in ``pixel_values``. :meth:`Tiles.prepare` counts them on the host at
the step boundary; :meth:`Tiles.cut` slices ``pixel_values`` at those counts. A piece without images carries no
``pixel_values`` (the template then embeds text alone; under DeepSpeed it runs a zero-weight placeholder tile), so its
gradient is its rows' own. A micro-batch whose context tokens are not whole tiles of ``pixel_values`` is refused at the
step boundary (OOM recovery off for it, said), never cut wrongly.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, ClassVar, Mapping, Sequence

import torch

from ...config.models import tile_merge_of, tile_tokens_of
from .base import InputKind, VisionBatch, _has_rows, batch_rows, row_patches

#: per row along dim 0
ROW_KEYS = ('input_ids', 'labels', 'attention_mask', 'loss_scale', 'position_ids', 'token_type_ids', 'channel',
            'inputs_embeds')
#: every tile of the micro-batch's images and frames
TILES_KEY = 'pixel_values'


class Tiles(InputKind):
    """Tiled-image micro-batches (module docstring).

    Args:
        setting: how a refusal names the model (``model_type: internvl``).
        image_token_id: the image-context token in ``input_ids``.
        tile_tokens: its tokens a tile.
        merge: patches a token (the pixel shuffle: ``1 / downsample_ratio^2``), so that a tile is
            ``tile_tokens x merge`` patches of the vision tower.
    """

    name: ClassVar[str] = 'tiles'
    packs: ClassVar[bool] = False  # the pack's padding-free packing does not carry images (refused before load)

    def __init__(self, setting: str = '', *, image_token_id: int, tile_tokens: int, merge: int = 4) -> None:
        super().__init__(setting)
        if tile_tokens < 1 or merge < 1:
            raise ValueError(f'tile_tokens and merge must be >= 1, got {tile_tokens}, {merge}')
        self.image_token_id = int(image_token_id)
        self.tile_tokens = int(tile_tokens)
        self.merge = int(merge)

    @classmethod
    def matches(cls, layout: str) -> bool:
        return layout == 'tiles'

    @classmethod
    def for_model(cls, setting: str, config: Any) -> 'Tiles':
        """The kind with the image token and tile size of a model's ``config``."""
        return cls(setting, image_token_id=config.image_token_id, tile_tokens=tile_tokens_of(config) or 1,
                   merge=tile_merge_of(config))

    def _row_tiles(self, batch: Mapping[str, Any]) -> tuple[list[int] | None, str | None]:
        """Each row's tiles, or why they cannot be told (host tensors: the loader's)."""
        tokens = (batch['input_ids'] == self.image_token_id).sum(dim=-1).tolist()
        tiles = batch.get(TILES_KEY)
        have = int(tiles.shape[0]) if isinstance(tiles, torch.Tensor) else 0
        if any(n % self.tile_tokens for n in tokens) or sum(tokens) != have * self.tile_tokens:
            return None, (f'the rows\' image tokens ({tokens}) are not whole tiles of {self.tile_tokens} tokens of '
                          f'{TILES_KEY} ({have} tiles), so the rows\' tiles cannot be told '
                          f'({self.setting or self.name})')
        return [n // self.tile_tokens for n in tokens], None

    def refusal(self, batch: Mapping[str, Any]) -> str | None:
        if not _has_rows(batch) or not isinstance(batch.get('input_ids'), torch.Tensor):
            return 'a micro-batch without an input_ids tensor cannot be cut into rows at its images'
        rows = batch_rows(batch)
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if key == TILES_KEY:
                if value.dim() != 4:
                    return f'micro-batch key {key!r} of shape {tuple(value.shape)} is not [tiles, C, H, W]'
            elif value.shape[0] != rows:
                return (f'micro-batch key {key!r} of shape {tuple(value.shape)} is not one a tiles input kind cuts '
                        f'({self.setting or self.name}); known: {", ".join((*ROW_KEYS, TILES_KEY))}')
        return self._row_tiles(batch)[1]

    def prepare(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping) or isinstance(batch, VisionBatch) or not isinstance(
                batch.get('input_ids'), torch.Tensor):
            return batch
        per_row, why = self._row_tiles(batch)
        if per_row is None:  # refused at the boundary: kept as it is, never cut
            return batch
        return VisionBatch(batch, {'tile': per_row}, {'tile': [self.tile_tokens * self.merge] * sum(per_row)})

    def cut(self, batch: Mapping[str, Any], bounds: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        if not isinstance(batch, VisionBatch):
            batch = self.prepare(batch)
        if not isinstance(batch, VisionBatch):
            raise ValueError(self.refusal(batch) or 'cannot cut this micro-batch at its tiles')
        rows = batch_rows(batch)
        starts = [0, *accumulate(batch.row_media['tile'])]
        parts: list[dict[str, Any]] = []
        for a, b in bounds:
            part: dict[str, Any] = {}
            for key, value in batch.items():
                if key == TILES_KEY:
                    if starts[b] > starts[a]:  # no tile in these rows: no pixel_values (text alone)
                        part[key] = value[starts[a]:starts[b]]
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    part[key] = value[a:b]
                elif isinstance(value, (list, tuple)) and len(value) == rows:
                    part[key] = value[a:b]
                else:
                    part[key] = value
            parts.append(part)
        return parts

    def vision_patches(self, batch: Mapping[str, Any]) -> list[int] | None:
        return row_patches(batch)

    def media_token_ids(self) -> tuple[int, ...]:
        return (self.image_token_id, )  # a video frame is a tile of the same token

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), 'tile_tokens': self.tile_tokens, 'merge': self.merge,
                'image_token_id': self.image_token_id}
