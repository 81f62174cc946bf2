"""The one pass-cost model: what a pass costs, how many pieces a pass must run as, the token budget after OOMs; and a
real run whose memory ends below ``pass_tokens``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swift_dynamic_callbacks.config.integration import IntegrationConfig
from swift_dynamic_callbacks.integrations.pass_budget import PassBudget
from swift_dynamic_callbacks.policies.balance import step_passes
from swift_dynamic_callbacks.policies.data_plan import piece_bounds
from swift_dynamic_callbacks.policies.pass_cost import (BudgetState, auto_pass_tokens, budget_after_oom,
                                                        budget_after_step, bytes_per_token, fits, pass_cost,
                                                        pieces_within, tolerance, vision_bytes_per_token,
                                                        vision_token_cost)
from swift_dynamic_callbacks.records import DecisionRecord

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first


def test_cost_and_fit_by_hand():
    assert pass_cost([], packed=False) == 0
    assert pass_cost([2000, 100], packed=False) == 4000 and pass_cost([2000, 100], packed=True) == 2100
    assert fits([5000], 100, packed=False)  # one row always fits: it cannot be cut further
    assert fits([60, 40], 100, packed=True) and not fits([60, 40], 100, packed=False)
    assert fits([60, 40], None, packed=False)


def test_a_packed_pass_the_planner_cut_is_not_cut_again():
    """The runner's pieces and the planner's passes use one cost: a padding-free pass of one 2,000-token row and
    28 of 500 (16,000 real tokens) fits 16,384 and runs as one pass (a ``tokens // longest`` cap made it four)."""
    lengths = [2000] + [500] * 28
    assert step_passes(lengths, len(lengths), 16384, padding_free=True) == [[29]]
    assert pieces_within(lengths, packed=True, tokens=16384) == 1
    assert pieces_within(lengths, packed=False, tokens=16384) > 1  # padded, the same rows cost 58,000


def test_a_rows_vision_work_adds_to_its_pass_and_cuts_it():
    """The vision tower runs on a row's own patches, never on padding: its work (in tokens) adds to the padded or
    packed tokens, row by row, and the fewest pieces that fit count it."""
    assert pass_cost([100, 100], packed=False, vision=[30, 0]) == 230
    assert pass_cost([100, 60], packed=True, vision=[5, 7]) == 172
    assert fits([100, 100], 200, packed=False) and not fits([100, 100], 200, packed=False, vision=[1, 0])
    assert fits([5000], 10, packed=False, vision=[9000])  # one row still always fits
    lengths = [10] * 4
    assert pieces_within(lengths, packed=False, tokens=60) == 1
    assert pieces_within(lengths, packed=False, tokens=60, vision=[30, 0, 0, 0]) == 2  # 70: [0:2] 50, [2:4] 20
    assert pieces_within(lengths, packed=False, tokens=60, vision=[45, 0, 45, 0]) == 4  # 55 alone, 65 with a row


def test_vision_bytes_a_token_by_hand():
    """A trained tower keeps a decoder layer's activations a patch and block (``10 w + 4 i`` gated, ``2 i`` not), x
    the calibrated block factor; with checkpointing one width a block plus one block; a frozen tower its output."""
    from swift_dynamic_callbacks.policies.pass_cost import FROZEN_OUTPUT_WIDTHS, VISION_BLOCK_FACTOR
    shape = dict(width=1280, intermediate=3420, depth=32, merge=4, out_width=3584, dtype_bytes=2)
    block = (10 * 1280 + 4 * 3420) * 2 * VISION_BLOCK_FACTOR
    gated = vision_bytes_per_token(**shape, gated=True, checkpointing=False, trained=True)
    assert gated == int(4 * 32 * block)
    plain = vision_bytes_per_token(**shape, gated=False, checkpointing=False, trained=True)
    assert plain == int(4 * 32 * (10 * 1280 + 2 * 3420) * 2 * VISION_BLOCK_FACTOR) < gated
    assert vision_bytes_per_token(**shape, gated=True, checkpointing=True, trained=True) == int(
        4 * (32 * 1280 * 2 + block))
    assert vision_bytes_per_token(**shape, gated=True, checkpointing=False, trained=False) == int(
        FROZEN_OUTPUT_WIDTHS * 3584 * 2) < gated
    llm = bytes_per_token(hidden=3584, intermediate=18944, layers=28, vocab=152064, dtype_bytes=2,
                          checkpointing=False)
    assert vision_token_cost(gated, llm) == gated / llm and 0.5 < gated / llm < 2  # a 7B: about as much again


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40), st.booleans(), st.integers(1, 20000),
       st.one_of(st.none(), st.integers(1, 16)), st.integers(1, 8))
def test_pieces_fit_respect_the_caps_and_are_fewest(lengths, packed, tokens, samples, requested):
    k = pieces_within(lengths, packed=packed, tokens=tokens, samples=samples, requested=requested)
    rows = len(lengths)
    assert 1 <= k <= rows
    bounds = piece_bounds(rows, k)
    for a, b in bounds:
        assert fits(lengths[a:b], tokens, packed=packed)
        assert samples is None or b - a <= samples or b - a == 1
    floor = max(1, requested, -(-rows // samples) if samples else 1)
    if floor < k:  # one piece fewer would not fit
        assert not all(fits(lengths[a:b], tokens, packed=packed) for a, b in piece_bounds(rows, k - 1))


def test_budget_after_an_oom_and_clean_steps_by_hand():
    state = budget_after_oom(BudgetState(), 1190, 1200)
    assert state == BudgetState(budget=595, good=None, bad=1190)
    state = budget_after_step(state, 1200, fitted=580, grow_after=2, probe_after=0)
    assert state.budget == 595 and state.clean == 1 and state.good == 580
    state = budget_after_step(state, 1200, fitted=590, grow_after=2, probe_after=0)
    assert (state.budget, state.good, state.bad) == (892, 590, 1190)  # far below the failure: halfway at once
    state = budget_after_oom(state, 640, 1200, fitted=600)  # the grown budget failed: the largest clean pass
    assert (state.budget, state.good, state.bad, state.crossed, state.probes) == (600, 600, 640, True, 1)
    state = budget_after_step(state, 1200, fitted=600, grow_after=1, probe_after=0)
    assert state.budget == 600 and state.settled == 1  # within an eighth of the failure: settled
    crossed = BudgetState(budget=400, good=400, bad=640, crossed=True)  # far below, but the end was crossed once:
    assert budget_after_step(crossed, 1200, fitted=400, grow_after=1, probe_after=0).budget == 450  # an eighth
    near = BudgetState(budget=500, good=500, bad=640)
    assert budget_after_step(near, 1200, fitted=500, grow_after=1, probe_after=0).budget == 562  # near: an eighth
    assert budget_after_step(BudgetState(), 1200, grow_after=2, probe_after=0) == BudgetState()  # nothing lowered
    assert budget_after_step(state, 1200, grow_after=0, probe_after=0) == state  # 0: never grows back
    # a pass as large as the failure ran clean since (one row over the budget): the failure is forgotten
    assert budget_after_step(state, 1200, fitted=640, grow_after=1, probe_after=0).bad is None


def test_a_one_off_oom_comes_back_to_the_ceiling():
    """An OOM with nothing after it: an eighth back each round toward the failure (the ceiling here), within 1/8 it
    settles, probes one step above after the quiet steps, runs clean there and is back at the ceiling."""
    state = budget_after_oom(BudgetState(), 16384, 16384)
    budgets = []
    for _ in range(200):
        budget = state.budget if state.budget is not None else 16384
        state = budget_after_step(state, 16384, fitted=budget, grow_after=2, probe_after=8)
        budgets.append(state.budget)
    assert budgets[-1] is None  # no lowered budget again
    assert budgets.index(None) <= 2 * 6 + 8 + 2


def test_a_failed_probe_settles_again_and_waits_four_times_longer():
    state = BudgetState(budget=900, good=900, bad=1000)
    for _ in range(7):
        state = budget_after_step(state, 2000, fitted=900, grow_after=2, probe_after=8)
        assert not state.probing
    state = budget_after_step(state, 2000, fitted=900, grow_after=2, probe_after=8)
    assert state.probing and state.budget == 1000 + tolerance(1000)
    state = budget_after_oom(state, 1050, 2000, fitted=960)
    assert (state.budget, state.good, state.bad, state.probes, state.probing) == (960, 960, 1000, 1, False)
    steps = 0
    while not state.probing:
        state = budget_after_step(state, 2000, fitted=960, grow_after=2, probe_after=8)
        steps += 1
    assert steps == 8 * 4
    # no headroom on the device: the probe waits for another quiet period
    settled = BudgetState(budget=960, good=960, bad=1000, settled=31, probes=1)
    held = budget_after_step(settled, 2000, fitted=960, grow_after=2, probe_after=8, headroom=False)
    assert not held.probing and held.settled == 0 and held.budget == 960


def _memory_end(ceiling: int, end: int, steps: int, probe_after: int, passes: list[float],
                grow_after: int = IntegrationConfig().oom_grow_back_steps) -> tuple[int, float]:
    """``steps`` steps, each running passes of the budget times ``passes`` (the planner fills a step's passes up to
    its budget); a pass over ``end`` runs out of memory and the step is run again at the new budget. Returns the
    OOMs and the mean of ``end / budget`` over the steps (passes against a run planned at the end)."""
    state, ooms, ratio = BudgetState(), 0, []
    for _ in range(steps):
        while True:
            budget = state.budget if state.budget is not None else ceiling
            costs = [max(1, int(budget * f)) for f in passes]
            failed = next((c for c in costs if c > end), None)
            fitted = max(costs[:costs.index(failed)] if failed else costs, default=0)
            if failed is None:
                ratio.append(end / budget)
                state = budget_after_step(state, ceiling, fitted=fitted, grow_after=grow_after, probe_after=probe_after)
                break
            ooms += 1
            state = budget_after_oom(state, failed, ceiling, fitted=fitted)
    return ooms, sum(ratio) / len(ratio)


@given(st.integers(1000, 20000), st.floats(0.3, 0.95), st.lists(st.floats(0.6, 1.0), min_size=1, max_size=4))
def test_a_real_memory_end_costs_a_bounded_number_of_ooms(ceiling, end_fraction, passes):
    """A memory end below the ceiling for 300 steps at the default settings (grow after every clean step, probe after
    64 settled ones): passes within 1.3x of a run planned at the end, and few OOMs: the first (a second one when the
    end is below half the failing pass), one when the growth crosses the end (halfway, then an eighth at a time),
    one probe (64 settled steps; 256 after a second OOM or a failed probe)."""
    end = int(ceiling * end_fraction)
    ooms, ratio = _memory_end(ceiling, end, 300, 64, passes)
    assert ratio <= 1.3, ratio
    assert ooms <= 4, ooms


@pytest.mark.parametrize('end_fraction', [0.75, 0.8, 0.9])
@pytest.mark.parametrize('passes', [[1.0], [0.9], [1.0, 0.7], [0.95, 0.9, 0.8]])
def test_a_first_oom_keeps_the_speed_of_a_short_run(end_fraction, passes):
    """A budget a little above the memory end (the user copied one too large for the card), a run of ten steps: the
    first OOM's budget (half the failing pass) grows halfway back to the failure after one clean step, so the run
    spends its steps near the end: at most 1.2x the passes of a run planned at it (at 03097fd, an eighth every two
    clean steps: up to 1.52x)."""
    ooms, ratio = _memory_end(1200, int(1200 * end_fraction), 10, 64, passes)
    assert ratio <= 1.2 and ooms <= 2, (ooms, ratio)


@pytest.mark.parametrize('end_fraction', [0.5, 0.6, 0.75, 0.9])
@pytest.mark.parametrize('passes', [[1.0], [0.9], [1.0, 0.7], [0.95, 0.9, 0.8]])
def test_a_memory_end_above_half_the_budget_costs_at_most_three_ooms_in_300_steps(end_fraction, passes):
    """The issue's goal (at 55fa141 the budget went back to the ceiling every 32 settled steps: an OOM every ~40
    steps)."""
    ooms, ratio = _memory_end(1200, int(1200 * end_fraction), 300, 64, passes)
    assert ooms <= 3 and ratio <= 1.3, (ooms, ratio)


def _oom(tokens: int) -> DecisionRecord:
    return DecisionRecord('integration', 'oom', 'recovered', {'pass_size': 2, 'pass_tokens': tokens, 'fitted': 0})


def test_pass_budget_records_each_change_and_round_trips():
    part = PassBudget(grow_after=1, probe_after=0)
    part.configure(tokens_ceiling=1200, rows=2)
    assert part.fold([], 1) is None and part.budget is None
    record = part.fold([_oom(1100), _oom(900)], 2)  # two ranks: the smaller failure decides
    assert record.kind == 'pass_budget' and record.reason == 'oom'
    assert record.values == {'unit': 'tokens', 'old': 1200, 'new': 450, 'ceiling': 1200, 'failed': 900,
                             'good': None, 'bad': 900, 'probes': 0}
    assert part.fold([_oom(100)], 2) is None  # a step is folded once (a checkpoint may have folded it first)
    grown = part.fold([], 3, fitted=440)
    # far below the failure (more than a quarter of it): halfway at once
    assert grown.reason == 'grow_back' and grown.values['old'] == 450 and grown.values['new'] == 675
    assert part.limit() == {'samples': None, 'tokens': 675, 'rules': []} and part.plan_tokens() == 675
    other = PassBudget()
    other.load_state_dict(part.state_dict())
    assert other.state_dict() == part.state_dict()
    part.configure(tokens_ceiling=None, rows=4)  # passes no longer cut by tokens: a budget in rows starts afresh
    assert part.budget is None and part.plan_tokens() is None


def test_pass_budget_in_rows_one_row_ooms_and_the_step_cap():
    part = PassBudget(grow_after=1, probe_after=0)
    part.configure(tokens_ceiling=None, rows=8)
    part.start_step(None)
    assert part.after_oom(1, 500) is None  # one row cannot be cut: no cap
    assert part.after_oom(8, 4000) == 4 and part.limit() == {'samples': 4, 'tokens': None, 'rules': []}
    one_row = DecisionRecord('integration', 'oom', 'recovered', {'pass_size': 1, 'pass_tokens': 500})
    assert part.fold([one_row], 1) is None and part.budget is None  # a one-row OOM lowers nothing
    record = part.fold([DecisionRecord('integration', 'oom', 'recovered', {'pass_size': 8, 'pass_tokens': 4000,
                                                                            'fitted': 0})], 2)
    assert record.values['unit'] == 'samples' and record.values['new'] == 4
    part.start_step(None)
    assert part.limit()['samples'] == 4
    grown = part.fold([], 3, fitted=4)
    assert grown.values['new'] == 6 and part.limit()['samples'] == 6  # halfway to the 8 that failed
    part.set_requested({'samples': 5, 'tokens': None, 'rules': [[100, 2]]})
    assert part.limit() == {'samples': 5, 'tokens': None, 'rules': [[100, 2]]}  # the smaller cap, once


def test_the_step_cap_after_an_oom_is_the_largest_pass_known_to_run_clean():
    """After an OOM the rest of the step runs within the largest pass known to run clean below the failing one (this
    step's, or the budget's since the first OOM), not half the failing pass: a grown budget of 978 tokens that fails
    goes back to the 870 that ran clean, where halving would run the rest of the step at 489."""
    part = PassBudget(grow_after=1, probe_after=0)
    part.configure(tokens_ceiling=1200, rows=4)
    part.start_step(None)
    assert part.after_oom(4, 1160) == 580  # nothing known yet: half
    part.fold([DecisionRecord('integration', 'oom', 'recovered', {'pass_size': 4, 'pass_tokens': 1160,
                                                                   'fitted': 580})], 1)
    part.start_step(None)
    part.ran(3, 870)
    part.fold([], 2, fitted=870)
    part.start_step(None)
    assert part.after_oom(4, 978) == 870  # the budget's clean pass
    part.start_step(None)
    part.ran(2, 700)
    assert part.after_oom(3, 760) == 700  # this step's clean pass below the failure
    assert part.after_oom(2, 600) == 300  # below every known clean pass: half


def test_auto_budget_from_the_shape_by_hand():
    """Qwen2.5-1.5B's shape in bf16 without checkpointing: 5.6 MB a token (a 16,384-token pass peaked at 81.7 GiB
    on an H200); with checkpointing the layers keep one hidden state each; an 80 GB card gets about 13k tokens."""
    shape = dict(hidden=1536, intermediate=8960, layers=28, vocab=151936, dtype_bytes=2)
    full = bytes_per_token(**shape, checkpointing=False)
    assert full == 18 * 151936 + 28 * (10 * 1536 + 4 * 8960) * 2 == 5602048
    assert bytes_per_token(**shape, checkpointing=True) == 18 * 151936 + 28 * 1536 * 2 + (10 * 1536 + 4 * 8960) * 2
    assert auto_pass_tokens(76 * 2**30, full) == 13056  # an H100 with the model loaded
    assert auto_pass_tokens(136 * 2**30, full) == 23296  # an H200
    assert auto_pass_tokens(10, full) == 256 and auto_pass_tokens(2**50, 1, maximum=8192) == 8192


def test_auto_on_a_cpu_reads_the_budget_or_falls_back(tiny_model_object):
    from swift_dynamic_callbacks.integrations.auto_budget import CPU_MAX_PASS_TOKENS, resolve_auto_pass_tokens
    for p in tiny_model_object.parameters():  # LoRA-like: nothing trainable, nothing held later
        p.requires_grad_(False)
    tokens, figures = resolve_auto_pass_tokens(tiny_model_object, 'cpu', checkpointing=False, cpu_budget_gib=0.01)
    per_token = figures['bytes_per_token']
    assert figures['grad_gib'] == figures['optimizer_gib'] == 0 and figures['trainable_params'] == 0
    assert tokens == auto_pass_tokens(0.01 * 2**30, per_token, multiple=16, minimum=16, maximum=CPU_MAX_PASS_TOKENS)
    assert figures['device'] == 'cpu' and figures['hidden_size'] == tiny_model_object.config.hidden_size
    tokens, figures = resolve_auto_pass_tokens(object(), 'cpu', checkpointing=False, cpu_budget_gib=4)
    assert tokens == 8192 and figures['how'].startswith('fallback')


def test_auto_counts_what_a_full_fine_tune_will_hold(tiny_model_object):
    """A full fine-tune read before its first backward and optimizer step: a gradient per weight and Adam's two
    moments are not allocated yet; the budget is what is left of the free memory after them (at 55fa141 they were
    left out: the budget of a LoRA run, and an OOM at step 2 on a real card). Once they exist nothing is subtracted
    twice; SGD without momentum holds no state; the compute dtype is bf16's under bf16."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.integrations.auto_budget import held_later, resolve_auto_pass_tokens
    params = sum(p.numel() for p in tiny_model_object.parameters())
    optimizer = torch.optim.AdamW(tiny_model_object.parameters())
    later = held_later(tiny_model_object, optimizer)
    assert later == {'trainable_params': params, 'grad_bytes': 4 * params, 'optimizer_bytes': 2 * 4 * params}
    budget = 0.05
    tokens, figures = resolve_auto_pass_tokens(tiny_model_object, 'cpu', checkpointing=False, cpu_budget_gib=budget,
                                               optimizer=optimizer)
    left = budget * 2**30 - 12 * params
    assert figures['left_gib'] == round(left / 2**30, 3)
    assert tokens == auto_pass_tokens(left, figures['bytes_per_token'], multiple=16, minimum=16, maximum=8192)
    tiny_model_object(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    assert held_later(tiny_model_object, optimizer)['grad_bytes'] == 0
    assert held_later(tiny_model_object, optimizer)['optimizer_bytes'] == 0
    sgd = torch.optim.SGD(tiny_model_object.parameters(), lr=0.1)
    assert held_later(tiny_model_object, sgd)['optimizer_bytes'] == 0
    _, figures = resolve_auto_pass_tokens(tiny_model_object, 'cpu', checkpointing=False, cpu_budget_gib=budget,
                                          args=SimpleNamespace(bf16=True))
    assert figures['dtype_bytes'] == 2
    for autocast, expected in ((True, 2), (False, 4)):  # fp16 on a CPU: accelerate runs no autocast
        _, figures = resolve_auto_pass_tokens(tiny_model_object, 'cpu', checkpointing=False, cpu_budget_gib=budget,
                                              args=SimpleNamespace(fp16=True), autocast=autocast)
        assert figures['dtype_bytes'] == expected


def test_auto_under_zero3_counts_what_zero3_holds_a_token(tiny_model_object):
    """ZeRO-3 held 1.37 x the estimated activation memory a token on an H100 (auto without it chose 9,728 tokens
    and ran out of memory at 8,883): its adapter asks for 1.5 x; ZeRO-2, DDP and one process for none."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.integrations.auto_budget import resolve_auto_pass_tokens
    from swift_dynamic_callbacks.integrations.engines import DDPEngine, DeepSpeedEngineAdapter, Engine

    def trainer(stage):
        plugin = SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))

    assert DeepSpeedEngineAdapter.activation_factor(trainer(3)) == 1.5
    assert DeepSpeedEngineAdapter.activation_factor(trainer(2)) == 1.0
    assert Engine.activation_factor(trainer(3)) == DDPEngine.activation_factor(trainer(3)) == 1.0
    plain, figures = resolve_auto_pass_tokens(tiny_model_object, 'cpu', checkpointing=False, cpu_budget_gib=0.05)
    zero3, zero3_figures = resolve_auto_pass_tokens(tiny_model_object, 'cpu', checkpointing=False,
                                                    cpu_budget_gib=0.05, activation_factor=1.5)
    assert zero3_figures['bytes_per_token'] == int(figures['bytes_per_token'] * 1.5)
    assert zero3_figures['engine_activation_factor'] == 1.5 and 'x 1.5 under this engine' in zero3_figures['how']
    assert zero3 == auto_pass_tokens(zero3_figures['left_gib'] * 2**30, zero3_figures['bytes_per_token'],
                                     multiple=16, minimum=16, maximum=8192) < plain


def test_auto_reads_a_moe_shape():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from swift_dynamic_callbacks.integrations.auto_budget import model_shape
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                               shared_expert_intermediate_size=24, num_experts=4,
                                               num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, vocab_size=100))
    shape = model_shape(model)
    assert shape['moe'] and shape['intermediate_size'] == 2 * 16 + 24


def test_a_linear_attention_layer_holds_more_a_token_by_hand():
    """Qwen3.5's Gated DeltaNet layers (3 of 4) hold their widths ``2 x keys + values`` x the fitted factor beyond a
    full-attention layer, in fp32 whatever the model's dtype (transformers' torch path computes them in fp32); with
    checkpointing the one layer recomputed is the larger."""
    from swift_dynamic_callbacks.policies.pass_cost import LINEAR_ATTENTION_WIDTHS
    shape = dict(hidden=4096, intermediate=12288, layers=32, vocab=248320, dtype_bytes=2)
    layer, width = (10 * 4096 + 4 * 12288) * 2, 2 * 16 * 128 + 32 * 128
    full = bytes_per_token(**shape, checkpointing=False)
    hybrid = bytes_per_token(**shape, checkpointing=False, linear_layers=24, linear_width=width)
    assert hybrid - full == 24 * LINEAR_ATTENTION_WIDTHS * width * 4
    assert bytes_per_token(**shape, checkpointing=True, linear_layers=24, linear_width=width) == (
        18 * 248320 + 32 * 4096 * 2 + layer + LINEAR_ATTENTION_WIDTHS * width * 4)
    in_fp32 = bytes_per_token(**{**shape, 'dtype_bytes': 4}, checkpointing=False, linear_layers=24,
                              linear_width=width) - bytes_per_token(**{**shape, 'dtype_bytes': 4}, checkpointing=False)
    assert in_fp32 == hybrid - full  # the linear layers' extra does not halve in bf16
    assert bytes_per_token(**shape, checkpointing=False, linear_width=width) == full  # no linear layer: no term


def _tiny_qwen3_5(trained_tower: bool, checkpointing: bool = False):
    import transformers
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512,
                layer_types=['linear_attention'] * 3 + ['full_attention'], linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={'rope_type': 'default', 'rope_theta': 1e7, 'partial_rotary_factor': 0.25,
                                 'mrope_section': [1, 1, 0], 'mrope_interleaved': True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=96, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                    vision_config=vision))
    for name, p in model.named_parameters():
        p.requires_grad_(trained_tower or '.visual.' not in f'.{name}')
    model.model.visual.gradient_checkpointing = checkpointing
    return model


def test_auto_and_the_vision_cost_read_a_qwen3_5_model():
    """The loaded model's shape: its linear-attention layers and their width, and its vision tower's cost an image
    token (2 x 2 patches merged), priced as trained where any of its weights trains."""
    from swift_dynamic_callbacks.integrations.auto_budget import model_shape, vision_cost
    from swift_dynamic_callbacks.policies.pass_cost import vision_bytes_per_token
    frozen = _tiny_qwen3_5(trained_tower=False)
    shape = model_shape(frozen)
    assert (shape['linear_layers'], shape['linear_width'], shape['num_hidden_layers']) == (3, 2 * 32 + 64, 4)
    token = bytes_per_token(hidden=64, intermediate=128, layers=4, vocab=512, dtype_bytes=4, checkpointing=False,
                            linear_layers=3, linear_width=128)
    costs = {}
    for trained, checkpointing in ((False, False), (True, False), (True, True)):
        cost, merge, figures = vision_cost(_tiny_qwen3_5(trained, checkpointing))
        vision = vision_bytes_per_token(width=32, intermediate=96, depth=3, gated=False, merge=4, out_width=64,
                                        dtype_bytes=4, checkpointing=checkpointing, trained=trained)
        assert cost == pytest.approx(vision / token) and merge == 4
        assert figures == {'vision_token_cost': round(vision / token, 4), 'vision_trained': trained,
                           'vision_checkpointing': checkpointing}
        costs[trained, checkpointing] = cost
    assert costs[False, False] < costs[True, True] < costs[True, False]
    from transformers import Qwen2Config, Qwen2ForCausalLM
    text_only = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=100))
    assert vision_cost(text_only) == (0.0, 1, {})


@pytest.fixture
def tiny_model_object():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=1000))


# ---- end to end ----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_swift_sft_memory_end_below_pass_tokens_settles_in_tokens(tmp_path, tiny_llama):
    """A device whose memory ends at 900 tokens a pass under ``pass_tokens: 1200``: the OOMs lower a token budget
    (rows never capped), the epoch runs within 1.5x the passes of a run planned at 900 from the start, with the
    losses of the run without OOMs."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, run_sft, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=32))

    def train(name, pass_tokens, memory_end):
        try:
            sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': pass_tokens},
                         integration={'oom_grow_back_steps': 1})
            with OomInjector(token_budget=memory_end) as injector:
                out = run_sft(tiny_llama, 'llama', data, str(tmp_path / name), callbacks=['length_batching'],
                              max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, lora_dropout=0.0, learning_rate=1e-3,
                              lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=1000, max_length=900,
                              truncation_strategy='right')
        finally:
            plugin.unregister()
        return out, injector

    free, _ = train('free', 1200, None)
    oom, injector = train('oom', 1200, 900)
    planned, planned_injector = train('planned', 900, 900)
    assert injector.counts['forward'] >= 1 and planned_injector.counts == {'forward': 0, 'backward': 0}
    assert len(injector.passes) <= 1.5 * len(planned_injector.passes), (len(injector.passes),
                                                                         len(planned_injector.passes))
    assert [r['loss'] for r in train_logs(oom)] == pytest.approx([r['loss'] for r in train_logs(free)], abs=1e-5)
    records = decisions(oom)
    ooms = [d for d in records if d['kind'] == 'oom']
    assert ooms and all(d['values']['new_pass_cap'] is None and d['values']['new_pass_tokens'] for d in ooms)
    budgets = [d for d in records if d['kind'] == 'pass_budget']
    assert budgets[0]['reason'] == 'oom' and budgets[0]['values']['new'] < 900
    assert any(d['reason'] == 'grow_back' for d in budgets)
    logged = [r['dynamic/pass_budget'] for r in train_logs(oom)]
    assert min(logged) < 900 and logged[0] == 1200


@pytest.mark.e2e
def test_swift_sft_pass_tokens_auto_plans_at_a_recorded_budget(tmp_path, tiny_llama):
    """``pass_tokens: auto`` on the CPU: the budget from half the available memory and the model's shape (at most
    8,192 on a CPU), one ``pass_tokens`` record with its figures, and the plan (and its passes) at that number."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, run_sft, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=16))
    try:
        sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': 'auto'})
        with OomInjector() as injector:
            out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'auto'), callbacks=['length_batching'],
                          max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2,
                          gradient_accumulation_steps=2, save_steps=1000, max_length=2048)
    finally:
        plugin.unregister()
    records = decisions(out)
    [auto] = [d for d in records if d['kind'] == 'pass_tokens']
    chosen = auto['values']['pass_tokens']
    assert auto['reason'] == 'auto' and auto['values']['device'] == 'cpu' and auto['values']['free_gib'] > 0
    vocab = auto['values']['vocab_size']
    assert vocab == 49152 and 256 <= chosen <= 8192 and auto['values']['bytes_per_token'] > 18 * vocab  # its logits
    [plan] = [d for d in records if d['kind'] == 'batch_plan' and d['source'] == 'length_batching']
    assert plan['values']['new']['pass_tokens'] == 'auto'
    assert {r['dynamic/pass_budget'] for r in train_logs(out)} == {chosen}
    assert all(rows == 1 or tokens <= chosen for rows, tokens in injector.passes)
    # float32 weights on a CPU, where ms-swift's fp16: true runs no autocast: 4 bytes an activation (2 at 03097fd)
    assert auto['values']['dtype_bytes'] == 4


@pytest.mark.e2e
def test_swift_sft_a_lowered_budget_survives_a_resume(tmp_path, tiny_llama):
    """The token budget an OOM lowered is in the checkpoint: a run resumed from it plans at that budget from its first
    step (no OOM again), and trains the uninterrupted run's samples with its losses."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, run_sft, sample_trace, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=24))

    def train(out, max_steps, **extra):
        try:
            sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': 1200},
                         integration={'record_samples': True, 'oom_grow_back_steps': 0})
            with OomInjector(token_budget=900) as injector:
                run_sft(tiny_llama, 'llama', data, str(out), callbacks=['length_batching'], max_steps=max_steps,
                        per_device_train_batch_size=2, gradient_accumulation_steps=2, lora_dropout=0.0,
                        learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=3,
                        max_length=900, truncation_strategy='right', **extra)
        finally:
            plugin.unregister()
        return injector

    full = tmp_path / 'full'
    train(full, 6)
    part = tmp_path / 'part'
    train(part, 3)  # the OOM comes in its first step
    [lowered] = [d['values']['new'] for d in decisions(str(part)) if d['kind'] == 'pass_budget']
    resumed_injector = train(part, 6, resume_from_checkpoint=str(part / 'checkpoint-3'), fresh=False)
    assert resumed_injector.counts == {'forward': 0, 'backward': 0}  # planned at the saved budget: no OOM
    assert all(rows == 1 or tokens <= lowered for rows, tokens in resumed_injector.passes)
    logs = train_logs(str(part))
    assert [r['dynamic/pass_budget'] for r in logs[3:]] == [lowered] * 3
    assert [r['batches'] for r in sample_trace(str(part))] == [r['batches'] for r in sample_trace(str(full))]
    assert [r['loss'] for r in logs] == pytest.approx([r['loss'] for r in train_logs(str(full))], abs=1e-5)


@pytest.mark.e2e
def test_swift_sft_memory_backoff_under_pass_tokens_caps_and_plans_in_tokens(tmp_path, tiny_llama):
    """memory_backoff under pass_tokens with a memory budget the process is always over: it caps a pass's *tokens*
    (never its rows), the integration plans the next steps within the cap, and every pass after a backoff keeps
    within it (or is one row)."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, run_sft, sample_trace, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=16))
    try:
        sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': 2000},
                     memory_backoff={'cpu_budget_gib': 0.5, 'clean_steps': 1},
                     integration={'record_samples': True})
        with OomInjector() as injector:
            out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'out'), callbacks=['length_batching',
                                                                                      'memory_backoff'],
                          max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2,
                          gradient_accumulation_steps=2, save_steps=1000, max_length=2048)
    finally:
        plugin.unregister()
    backoffs = [d for d in decisions(out) if d['kind'] == 'pass_limit' and d['reason'] == 'backoff']
    assert backoffs and all(d['values']['unit'] == 'tokens' for d in backoffs)
    requested = [d for d in decisions(out) if d['kind'] == 'pass_limit' and d['source'] == 'control_flags']
    assert all(d['values']['new']['samples'] is None for d in requested)  # never a row cap
    logs = train_logs(out)
    caps = [r['dynamic/pass_cap'] for r in logs]
    assert all(r['dynamic/pass_cap_unit'] == 1 for r in logs) and caps[-1] < 2000
    budgets = [r['dynamic/pass_budget'] for r in logs]
    assert budgets[0] == 2000 and budgets[-1] == caps[-2]  # the steps after a backoff are planned within its cap
    step_of_pass = [p for row in sample_trace(out) for p in [row['step']] * sum(row['passes'])]
    assert len(step_of_pass) == len(injector.passes)
    for step, (rows, tokens) in zip(step_of_pass, injector.passes):
        if step > 1:  # planned after the first backoff
            assert rows == 1 or tokens <= caps[step - 2], (step, rows, tokens)


@pytest.mark.e2e
def test_swift_sft_pass_tokens_auto_on_a_full_fine_tune_fits_its_device(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    """``pass_tokens: auto`` on a full fine-tune, on a simulated device whose memory holds the run's gradients and
    Adam's moments besides the passes (``faults.device_end``): the budget read at the first boundary leaves room for
    them (a ``pass_tokens`` record with ``grad_gib`` and ``optimizer_gib``), so no pass runs out of memory, at step 2
    either, when the moments exist (at 55fa141 the budget counted free memory only: every pass over the end)."""
    import swift_dynamic_callbacks as sdc
    from swift.callbacks import TrainerCallback, callbacks_map
    from swift_dynamic_callbacks.integrations import auto_budget
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector, device_end
    from swift_runs import decisions, run_sft
    total = int(0.1 * 2**30)
    monkeypatch.setattr(auto_budget, '_available_cpu_bytes', lambda: 2 * total)  # auto takes half: the device
    injector = OomInjector()

    class Device(TrainerCallback):
        def __init__(self, args, trainer):
            super().__init__(args, trainer)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            c = self.trainer.model.config
            per_token = bytes_per_token(hidden=c.hidden_size, intermediate=c.intermediate_size,
                                        layers=c.num_hidden_layers, vocab=c.vocab_size, dtype_bytes=4,
                                        checkpointing=False)
            injector.token_budget = device_end(self.trainer.model, lambda: self.trainer.optimizer, total, per_token)

    callbacks_map['device_end'] = Device
    try:
        sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': 'auto'})
        with injector:
            out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'full'),
                          callbacks=['length_batching', 'device_end'], tuner_type='full', max_steps=4,
                          per_device_train_batch_size=8, gradient_accumulation_steps=1, max_length=48,
                          truncation_strategy='right', save_steps=1000)
    finally:
        plugin.unregister()
        callbacks_map.pop('device_end', None)
    [auto] = [d for d in decisions(out) if d['kind'] == 'pass_tokens']
    assert auto['values']['grad_gib'] > 0 and auto['values']['optimizer_gib'] > 0
    assert injector.counts == {'forward': 0, 'backward': 0}, auto['values']
    assert max(tokens for _, tokens in injector.passes) > auto['values']['pass_tokens'] // 2  # passes filled it


@pytest.mark.slow
@pytest.mark.e2e
def test_swift_sft_a_first_oom_keeps_the_speed_of_a_ten_step_epoch(tmp_path, tiny_llama):
    """Issue 56's held-out shape: ``pass_tokens: 1200`` on a device whose memory ends at 900 tokens a pass, one
    problem a row (many rows a pass), 4 x GA 4, 160 rows: a ten-step epoch. The first OOM halves the failing pass;
    the budget grows halfway back after one clean step and settles near the end, so the epoch runs within 1.3x the
    passes (failed ones included) of a run planned at 900 (at 03097fd: 1.35x here, an eighth every two steps).
    Slow (two minutes): ``pytest -m slow``; ``test_a_first_oom_keeps_the_speed_of_a_short_run`` holds the same policy
    in the default run, and ``scripts/bench_memory_end.py --data gsm8k`` prints the figure."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    from swift_runs import decisions, run_sft
    data = str(write_gsm8k_dataset(tmp_path / 'gsm8k.jsonl', 160))

    def passes(name, pass_tokens):
        try:
            sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': pass_tokens})
            with OomInjector(token_budget=900) as injector:
                out = run_sft(tiny_llama, 'llama', data, str(tmp_path / name), callbacks=['length_batching'],
                              max_steps=-1, num_train_epochs=1, per_device_train_batch_size=4,
                              gradient_accumulation_steps=4, lora_dropout=0.0, learning_rate=1e-3,
                              lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=1000, max_length=900,
                              truncation_strategy='right', logging_steps=5)
        finally:
            plugin.unregister()
        return len(injector.passes), injector.counts['forward'], decisions(out)

    oom, ooms, records = passes('oom', 1200)
    planned, planned_ooms, _ = passes('planned', 900)
    assert ooms >= 1 and planned_ooms == 0
    assert oom <= 1.3 * planned, (oom, planned, [(r['step'], r['reason'], r['values']['new'])
                                                 for r in records if r['kind'] == 'pass_budget'])
