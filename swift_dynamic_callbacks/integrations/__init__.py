"""Host-specific code: the only modules that know HF Trainer / ms-swift internals."""

from .trainer import Integration, IntegrationConfig, install

__all__ = ['Integration', 'IntegrationConfig', 'install']
