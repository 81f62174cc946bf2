"""ms-swift ``external_plugins`` entry: registers the pack's callbacks (``swift-dynamic plugin-path`` prints this
path)."""

from swift_dynamic_callbacks.integrations.swift import register

register()
