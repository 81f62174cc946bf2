"""What an input kind knows: how a collated micro-batch of its model family is cut into passes of whole rows.

A collated micro-batch is a mapping of tensors; which of them hold one entry a row depends on the model family.
Text rows hold everything a row (``[B, L]``), so slicing along dim 0 cuts them. A Qwen-VL micro-batch holds every
image's patches concatenated (``pixel_values``: rows = patches), one ``image_grid_thw`` row an image and
``position_ids`` ``[3, B, L]`` (3-D rotary positions): slicing dim 0 is wrong for each of these, and silently so when
the counts happen to equal the batch's rows. An input kind says, for its family:

- :meth:`InputKind.matches`: whether a run's model is of this kind, by the layout its config describes
  (:func:`...config.models.layout_of`: asked at train start, in registry order; ``swift-dynamic check`` reads the
  same layout from the model folder's ``config.json`` before it loads);
- :meth:`InputKind.refusal`: a key of a micro-batch it cannot cut (the step runner asks it of every real micro-batch at
  its step boundary, before any pass runs: a refused key turns OOM recovery off and refuses every setting that would
  cut, naming the key; never a ``ValueError`` mid-run);
- :meth:`InputKind.prepare`: on the host, at the step boundary, what cutting needs later without reading the device
  (a Qwen-VL batch: its rows' images and their patch counts);
- :meth:`InputKind.cut`: the micro-batch as pieces of contiguous rows, each a valid micro-batch of the family
  (host ints and slices only: no device synchronisation);
- :meth:`InputKind.vision_patches`: the patches each row sends through a vision tower (the cost model prices them);
- :attr:`InputKind.packs`: whether the pack's own padding-free packing (``length_batching.padding_free``) may pack
  its rows.

A packed micro-batch (:class:`~..attention.PackedBatch`) is cut at its row boundaries by
:func:`~..padding_free.split_packed`, whatever the kind.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch


def _has_rows(batch: Mapping[str, Any]) -> bool:
    reference = batch.get('input_ids', batch.get('labels'))
    return isinstance(reference, torch.Tensor) and reference.dim() > 0


def batch_rows(batch: Mapping[str, Any]) -> int:
    """The rows of a collated micro-batch: the first dimension of its ``input_ids`` (else ``labels``)."""
    reference = batch.get('input_ids', batch.get('labels'))
    if not isinstance(reference, torch.Tensor) or reference.dim() == 0:
        raise ValueError('cannot cut a micro-batch without an input_ids or labels tensor')
    return int(reference.shape[0])


class VisionBatch(dict):
    """A vision-language micro-batch with, on the host, each row's images and videos and each one's patches (an
    input kind's :meth:`InputKind.prepare`).

    Attributes:
        row_media: per media kind (``image``, ``video``): the images (videos) of each row, in order.
        patches: per media kind: the patches of each image (video), in order.
    """

    def __init__(self, values: Mapping[str, Any], row_media: Mapping[str, Sequence[int]],
                 patches: Mapping[str, Sequence[int]]) -> None:
        super().__init__(values)
        self.row_media = {k: tuple(int(n) for n in v) for k, v in row_media.items()}
        self.patches = {k: tuple(int(n) for n in v) for k, v in patches.items()}

    def rebuild(self, values: Mapping[str, Any]) -> 'VisionBatch':
        """The same rows' facts over other values (the batch's tensors moved to the device)."""
        return VisionBatch(values, self.row_media, self.patches)


def row_patches(batch: Any) -> list[int] | None:
    """The vision-tower patches of each row of a :class:`VisionBatch` (``None``: another batch)."""
    if not isinstance(batch, VisionBatch):
        return None
    out = [0] * batch_rows(batch)
    for media, per_row in batch.row_media.items():
        sizes = iter(batch.patches[media])
        for r, n in enumerate(per_row):
            out[r] += sum(next(sizes) for _ in range(n))
    return out


class InputKind:
    """One model family's micro-batches (module docstring). Stateless; one instance in the registry.

    Attributes:
        name: how records and messages name it.
        packs: whether ``length_batching.padding_free`` may pack its rows into one row.
        setting: the setting that names the family in a refusal (``model_type: qwen2_vl``); set by :meth:`for_run`.
    """

    name: ClassVar[str] = ''
    packs: ClassVar[bool] = True

    def __init__(self, setting: str = '') -> None:
        self.setting = setting

    @classmethod
    def matches(cls, layout: str) -> bool:
        """Whether a run whose model's micro-batches have ``layout`` (:data:`...config.models.LAYOUTS`) is this
        kind's."""
        raise NotImplementedError

    @classmethod
    def for_model(cls, setting: str, config: Any) -> 'InputKind':
        """The kind for a run whose model has ``config`` (``setting``: how a refusal names the model)."""
        return cls(setting)

    def refusal(self, batch: Mapping[str, Any]) -> str | None:
        """Why ``batch`` cannot be cut into passes (a key this kind does not know how to cut), else ``None``."""
        raise NotImplementedError

    def prepare(self, batch: Any) -> Any:
        """``batch`` on the host with what :meth:`cut` needs later (default: as it is)."""
        return batch

    def cut(self, batch: Mapping[str, Any], bounds: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        """``batch`` as one piece a ``(start, stop)`` row range of ``bounds`` (contiguous, in order, covering every
        row)."""
        raise NotImplementedError

    def image_rule(self, trainer: Any) -> Any:
        """How the run's images are resized (:class:`~...policies.vision.ResizeRule`), so that a lazily tokenised
        row's images are counted from their headers (``None``: no images)."""
        return None

    def vision_patches(self, batch: Mapping[str, Any]) -> list[int] | None:
        """The vision-tower patches of each row of a batch :meth:`prepare` saw (``None``: no vision tower)."""
        return None

    def media_token_ids(self) -> tuple[int, ...]:
        """The placeholder tokens of the images and videos in a row's ``input_ids`` (one a token the tower sends)."""
        return ()

    def describe(self) -> dict[str, Any]:
        return {'input_kind': self.name, 'packs': self.packs}
