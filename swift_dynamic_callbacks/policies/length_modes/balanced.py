"""``balanced``: every micro-batch holds the per-device batch size (the cap decides), and the epoch is laid out in
balanced global steps (:mod:`..balance`; the layout and sizes there, not here); with ``pass_tokens`` each rank's
share of a step runs in as few passes as fit that budget."""

from __future__ import annotations

from .base import LengthMode, Plan


class BalancedMode(LengthMode):
    """Balanced global steps; reads ``pass_tokens``."""

    name = 'balanced'
    reads = ('pass_tokens', )
    balances_steps = True

    def limit(self, plan: Plan, longest: int) -> int:
        return 1 << 30  # the per-device batch size (the cap) decides

    def describe(self, plan: Plan) -> str:
        return (f'balanced: every step the global batch, of similar lengths (jitter {plan.bucket_width}), ranks\' '
                'work even, micro-batches of the per-device size')
