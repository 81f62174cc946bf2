"""What the settings say about a run's model family before it loads (no torch): whether its micro-batches hold
images the pack cuts at their rows (Qwen-VL), so that ``swift-dynamic check`` can refuse what such a run cannot do.
The input kinds that cut them at train start (``integrations/input_kinds/``) read the same table."""

from __future__ import annotations

import re
from typing import Any, Mapping

#: ms-swift model types whose templates collate Qwen-VL micro-batches (images / videos beside the text)
QWEN_VL_TYPES = ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe', 'qvq', 'mimo_vl')

#: hub ids of Qwen-VL models, for a YAML that names the model without ``model_type``
_QWEN_VL_ID = re.compile(r'(qwen[23](\.5)?-vl|qvq|mimo-vl)', re.IGNORECASE)


def qwen_vl_model(settings: Mapping[str, Any]) -> str | None:
    """The setting that makes a run a Qwen-VL one (``model_type: qwen2_5_vl``, or ``model: <a Qwen-VL id>`` when no
    ``model_type`` is given), else ``None``."""
    model_type = settings.get('model_type')
    if model_type:
        return f'model_type: {model_type}' if model_type in QWEN_VL_TYPES else None
    model = str(settings.get('model') or '')
    return f'model: {model}' if _QWEN_VL_ID.search(model.rsplit('/', 1)[-1]) else None
