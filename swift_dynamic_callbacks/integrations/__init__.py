"""Host-specific code: the only modules that know HF Trainer / ms-swift internals."""

import logging

_logger = logging.getLogger('swift_dynamic_callbacks')
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter('[swift-dynamic-callbacks] %(message)s'))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False

from .hooks import install  # noqa: E402 - after the logger is set up
from .trainer import Integration, IntegrationConfig  # noqa: E402

__all__ = ['Integration', 'IntegrationConfig', 'install']
