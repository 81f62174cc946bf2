"""The control-flag protocol: every attribute a pack callback may set on HF's ``TrainerControl``.

Callbacks never call the trainer: they set flags on the ``control`` every HF callback event receives, and one
integration (``integrations.trainer``) reads them at the next optimizer-step boundary, acts on them and clears them.
Who sets each flag, who reads it, when it is cleared and what a value asks for is the table in
``docs/control-flags.md`` (the one reference; the modules below only point at it).

- :mod:`.flags`: the flags' names and the checks of their values;
- :mod:`.requests`: the request kinds (:data:`~.requests.REQUESTS`), reading, clearing and merging requests, the
  ``request_*`` helpers, the unhonoured-request watchdog;
- :mod:`.decisions`: decision records (queued, drained at every boundary), log metrics, the controls a callback claims;
- :mod:`.events`: what the integration measures and hands callbacks (gradient noise, OOM events, non-finite losses).

Every name is re-exported here: ``from swift_dynamic_callbacks import protocol; protocol.request_batch_size(...)``.
"""

from . import decisions, events, flags, requests
from .decisions import *  # noqa: F403 - the package's face: every module's __all__ re-exported
from .events import *  # noqa: F403
from .flags import *  # noqa: F403
from .requests import *  # noqa: F403

__all__ = [*flags.__all__, *requests.__all__, *decisions.__all__, *events.__all__]
