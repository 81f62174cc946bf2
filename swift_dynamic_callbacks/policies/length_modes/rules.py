"""``rules``: the size of the last rule ``[longer_than, samples]`` with ``longest > longer_than`` (the seed's rule
``[[0, 8], [1024, 2]]``: longest > 1024 tokens -> 2 samples, else 8)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .base import LengthMode, Plan

DEFAULT_RULES: tuple[tuple[int, int], ...] = ((0, 8), (1024, 2))


def check_rules(rules: Any) -> tuple[tuple[int, int], ...]:
    """``{longer_than: samples}`` or ``[[longer_than, samples], ...]`` -> sorted tuple; the first threshold is 0."""
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules or ())
    out = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f'rules: each rule is [longer_than, samples], got {item!r}')
        threshold, size = item
        if isinstance(threshold, str) and threshold.strip().isdigit():
            threshold = int(threshold)
        for what, value, low in (('longer_than', threshold, 0), ('samples', size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f'rules: {what} must be an int >= {low}, got {value!r} in {item!r}')
        out.append((threshold, size))
    out.sort()
    if not out or out[0][0] != 0:
        raise ValueError(f'rules: need a rule for longer_than 0 (the size of short batches), got {out!r}')
    if len({t for t, _ in out}) != len(out):
        raise ValueError(f'rules: a longer_than threshold appears twice in {out!r}')
    return tuple(out)


def rule_size(rules: Sequence[tuple[int, int]], longest: int) -> int:
    """Samples allowed by the last rule with ``longest > longer_than`` (the first rule when none matches)."""
    size = rules[0][1]
    for threshold, samples in rules:
        if longest > threshold:
            size = samples
    return size


class RulesMode(LengthMode):
    """Sized by the ``rules`` table (:func:`rule_size`)."""

    name = 'rules'
    reads = ('rules', )

    def limit(self, plan: Plan, longest: int) -> int:
        return rule_size(plan.rules, longest)

    def sizes(self, plan: Plan) -> str:
        return 'sizes by ' + ', '.join(f'>{t}: {s}' for t, s in plan.rules)

    def pass_limit(self, plan: Plan) -> dict[str, Any]:
        """``{'samples': rules[0], 'rules': [[longer_than, samples], ...]}``: a pass of rows longer than
        ``longer_than`` tokens holds at most ``samples``."""
        return {'samples': plan.rules[0][1], 'tokens': None, 'rules': [[t, n] for t, n in plan.rules if t > 0]}
