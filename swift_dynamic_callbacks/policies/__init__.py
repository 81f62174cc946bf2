"""Pure policy functions: no torch, no filesystem, no trainer. Table- and property-tested."""
