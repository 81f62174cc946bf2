"""What a training pass's loss is, so that a micro-batch run as several passes keeps its gradient.

ms-swift's causal-LM loss is a *token sum* normalised by ``num_items_in_batch`` (the label tokens of the whole step):
pieces of a micro-batch run with the same ``num_items_in_batch`` add up to it as they are. Other losses are a *mean
per call*: HF's label smoother (``label_smoothing_factor``) averages the call's label tokens, a sequence classifier
(``task_type: seq_cls``) its rows; two halves then add up to twice the micro-batch's loss unless each is weighted by
its share (:func:`piece_weights`). Losses whose pieces do not add up at all (contrastive and listwise losses that
compare the rows of a call, a custom ``loss_type`` / ``compute_loss_func``, a MoE load-balancing term) are
``unknown``: the pack cannot cut such a micro-batch without changing its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..config.rules import custom_loss_name, loss_kind_of

KINDS = ('token_sum', 'token_mean', 'row_mean', 'unknown')


@dataclass(frozen=True)
class LossKind:
    """The kind of a run's training loss (:data:`KINDS`), the setting that makes it so and why.

    Attributes:
        kind: ``token_sum`` (pieces add up as they are), ``token_mean`` (a mean over the call's label tokens),
            ``row_mean`` (a mean over the call's rows) or ``unknown`` (pieces do not add up to the whole).
        setting: the setting that decided it, as a user writes it (``label_smoothing_factor: 0.1``); ``None`` for
            the default token sum.
        why: one sentence for records and messages.
        shift: ``token_mean``: label tokens are counted after the causal shift (``labels[..., 1:]``), as HF's label
            smoother counts them for a causal LM.
    """

    kind: str
    setting: str | None
    why: str
    shift: bool = False

    @property
    def splittable(self) -> bool:
        """Whether a micro-batch may run as weighted pieces with the same gradient."""
        return self.kind != 'unknown'


def _causal(model: Any) -> bool:
    """Whether HF's label smoother shifts labels for ``model`` (a causal LM inside any wrapper), as HF and ms-swift
    decide it: the transformers model's class name among the causal-LM classes."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    base = next((m for m in modules if isinstance(m, PreTrainedModel)), None)
    name = base._get_name() if base is not None else type(model).__name__
    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def model_is_moe(trainer: Any) -> bool:
    """Whether ``trainer``'s model is a mixture of experts, as ms-swift registered it (``True`` where unknown: a
    balancing loss is then assumed to be one)."""
    return bool(getattr(getattr(getattr(trainer, 'model', None), 'model_info', None), 'is_moe_model', True))


def loss_kind(trainer: Any) -> LossKind:
    """The kind of ``trainer``'s training loss, from its settings (read at train start; :func:`..config.rules.
    loss_kind_of`, the launch check's rule)."""
    args = trainer.args
    template = getattr(trainer, 'template', None)
    kind, setting, why = loss_kind_of(
        task_type=getattr(trainer, 'task_type', None) or getattr(template, 'task_type', None),
        loss_type=getattr(args, 'loss_type', None),
        compute_loss_func=custom_loss_name(getattr(trainer, 'compute_loss_func', None)),
        label_smoothing_factor=float(getattr(args, 'label_smoothing_factor', 0) or 0),
        router_aux_loss_coef=float(getattr(args, 'router_aux_loss_coef', 0) or 0),
        moe=model_is_moe(trainer),
        accepts_loss_kwargs=getattr(trainer, 'model_accepts_loss_kwargs', True) is not False)
    return LossKind(kind, setting, why, shift=kind == 'token_mean' and _causal(getattr(trainer, 'model', None)))


def _share(kind: LossKind, batch: Mapping[str, Any]) -> int:
    if kind.kind == 'row_mean':
        ids = batch.get('labels', batch.get('input_ids'))
        return int(ids.shape[0]) if isinstance(ids, torch.Tensor) else 1
    labels = batch['labels']
    if kind.shift:
        labels = labels[..., 1:]
    return int((labels != -100).sum())


def piece_weights(kind: LossKind, pieces: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """The factor each piece's loss is multiplied by so that the pieces add up to the whole micro-batch's loss:
    ``None`` for a token sum (1 each), else each piece's share of the label tokens (``token_mean``) or rows
    (``row_mean``); equal shares where the whole has none (its loss is not defined either)."""
    if kind.kind == 'token_sum' or len(pieces) <= 1:
        return None
    shares = [_share(kind, p) for p in pieces]
    total = sum(shares)
    if total <= 0:
        return [1.0 / len(pieces)] * len(pieces)
    return [s / total for s in shares]


def weigh(result: Any, weight: float | None) -> Any:
    """``compute_loss``'s result (a loss, or ``(loss, outputs)``) with its loss times ``weight`` (``None``: as is)."""
    if weight is None:
        return result
    if isinstance(result, tuple):
        return (result[0] * weight, *result[1:])
    return result * weight
