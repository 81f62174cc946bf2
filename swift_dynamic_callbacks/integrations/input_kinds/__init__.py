"""The input kinds a micro-batch is cut by, one a module (:mod:`.base` says what each knows).

Adding a model family: a module with an :class:`~.base.InputKind` subclass and its line in :data:`INPUT_KINDS` (asked
in order; the text kind last). The step runner (:mod:`..steps`: OOM recovery, pieces, pass limits, the over-estimate
split), the host preparation of a step's batches (:mod:`..inputs`) and the cost model then serve it.
"""

from __future__ import annotations

from typing import Any

from ...config.models import layout_by_name, layout_of, unsupported_why
from .base import InputKind, VisionBatch, batch_rows
from .qwen_vl import QWEN_VL_TYPES, QwenVL
from .text import MEDIA_KEYS, TextRows
from .tiles import Tiles

#: the kinds, asked in order by :func:`select_input_kind`
INPUT_KINDS: tuple[type[InputKind], ...] = (QwenVL, Tiles, TextRows)


class Unsupported(InputKind):
    """A multimodal model no kind claims: its micro-batches are never cut (the refusal names the model)."""

    name = 'unsupported'
    packs = False

    @classmethod
    def matches(cls, layout: str) -> bool:
        return True

    def refusal(self, batch: Any) -> str | None:
        return unsupported_why(self.setting)

    def cut(self, batch: Any, bounds: Any) -> list[dict[str, Any]]:
        raise ValueError(self.refusal(batch))


def run_model(trainer: Any) -> tuple[str | None, str, Any]:
    """``(model_type, layout, config)`` of a trainer's model: ms-swift's model info and template where they are (the
    model type it was registered under), else the transformers config; the layout of its micro-batches from the
    config (:func:`...config.models.layout_of`: the rule ``swift-dynamic check`` applies to ``config.json``), a
    template that takes media making a text layout ``multimodal``."""
    model = getattr(trainer, 'model', None)
    template = getattr(trainer, 'template', None)
    info = getattr(model, 'model_info', None) or getattr(template, 'model_info', None)
    config = getattr(info, 'config', None) or getattr(model, 'config', None)
    model_type = getattr(info, 'model_type', None) or getattr(config, 'model_type', None)
    meta = getattr(template, 'model_meta', None) or getattr(model, 'model_meta', None)
    layout = layout_of(config) if config is not None else 'text'
    if layout == 'text' and getattr(meta, 'is_multimodal', False):
        layout = layout_by_name(model_type) or 'multimodal'
    return model_type, layout, config


def select_input_kind(trainer: Any) -> InputKind:
    """The kind of a trainer's micro-batches: the first of :data:`INPUT_KINDS` that matches its model's layout; a
    multimodal model none matches is :class:`Unsupported`."""
    model_type, layout, config = run_model(trainer)
    setting = f'model_type: {model_type}' if model_type else ''
    for kind in INPUT_KINDS:
        if kind.matches(layout):
            return kind.for_model(setting, config)
    return Unsupported(setting or 'this model')


__all__ = ['INPUT_KINDS', 'MEDIA_KEYS', 'QWEN_VL_TYPES', 'InputKind', 'QwenVL', 'TextRows', 'Tiles', 'Unsupported',
           'VisionBatch', 'batch_rows', 'run_model', 'select_input_kind']
