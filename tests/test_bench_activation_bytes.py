"""The activation-bytes benchmark (benchmarks/activation_bytes.py): its storage counter, its table, and, in the
engines step, the claim docs/engines.md makes from it: on CPU FSDP2 and ZeRO-3 hold no more bytes a token than no
engine."""

from __future__ import annotations

import pytest
import torch

from benchmarks import activation_bytes as bench


def test_the_counter_holds_what_is_alive_at_once_and_ignores_what_existed():
    kept = torch.ones(1000)
    mode = bench.peak_mode()(keep=[kept])
    with mode:
        a = torch.ones(256)                 # 1 KiB
        b = torch.ones(512)                 # 2 KiB: 3 alive
        view = b[:10]                       # the same storage: not counted again
        del a
        c = kept.mul_(2)                    # in place on a storage alive before: never counted
        d = torch.ones(128)                 # 0.5 KiB: 2.5 alive
    assert mode.peak == 3 * 1024 and mode.cur == 2.5 * 1024
    del b, view, d, c
    assert mode.cur == 0


def test_the_table_gives_each_slope_its_ratio_and_the_fixed_part():
    def at(engine, tokens, forward, peak, cuda=None):
        return {'engine': engine, 'tokens': tokens, 'forward_mib': forward, 'peak_mib': peak, 'held_after_mib': 1.0,
                **({} if cuda is None else {'cuda_peak_mib': cuda})}
    rows = {'none': {100: at('none', 100, 5.0, 10.0, 12.0), 200: at('none', 200, 10.0, 20.0, 24.0)},
            'zero3': {100: at('zero3', 100, 6.0, 115.0, 120.0), 200: at('zero3', 200, 11.0, 130.0, 156.0)},
            'fsdp2': {100: at('fsdp2', 100, 5.0, 10.0)}}  # one length failed: no row
    lines = bench.table(rows, [100, 200]).splitlines()
    cells = {line.split(' | ')[0].strip('| '): [c.strip(' |') for c in line.split(' | ')[1:]] for line in lines[2:]}
    assert set(cells) == {'none', 'zero3'}
    assert cells['zero3'] == ['0.0500', '1.00', '0.1500', '1.50', '0.3600', '3.00', '100.0', '1.0']
    assert cells['none'][1] == cells['none'][3] == '1.00'


@pytest.mark.engines
@pytest.mark.slow  # a benchmark's figures (scripts/bench_activation_bytes.py), out of CI's engine run
def test_fsdp2_and_zero3_hold_the_bytes_a_token_of_no_engine_on_cpu(capsys):
    pytest.importorskip('deepspeed')
    assert bench.main(['--shape', '128', '512', '4', '2', '--layers', '2', '--tokens', '128', '256',
                       '--dtype', 'float32']) == 0
    out = capsys.readouterr().out
    assert '[arm-skipped]' not in out, out
    rows = {line.split(' | ')[0].strip('| '): line.split(' | ') for line in out.splitlines()
            if line.startswith(('| none', '| fsdp2', '| zero3'))}
    assert set(rows) == {'none', 'fsdp2', 'zero3'}, out
    for column in (2, 4):  # x no engine: what the forward leaves for the backward, and the pass's peak
        assert float(rows['fsdp2'][column]) == pytest.approx(1.0, abs=0.05), out
        assert 0.8 <= float(rows["zero3"][column]) <= 1.15, out
