"""Padding-free micro-batches (``length_batching.padding_free``): the packed row gives the padded micro-batch's loss
and gradient and never attends across rows (both tiny models, sdpa and eager, fp32; flex_attention's loss on CPU,
where it has no backward; flash attention's varlen path through a stand-in kernel that reads the rows' boundaries),
the train-start proof refuses what would mix rows, the choice of attention, the token budget counts real tokens, and
a real swift sft run trains as the padded one does."""

from __future__ import annotations

import json

import pytest
import torch

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.packed_attention import best_packed_attention, check_packed_attention, \
    use_packed_attention
from swift_dynamic_callbacks.integrations.attention.flex import FLEX_BLOCK
from swift_dynamic_callbacks.integrations.padding_free import PackedBatch, flatten_rows, packed_rows_only, split_packed
from swift_dynamic_callbacks.policies.length import BatchPlan, greedy_pieces

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first


def padded_batch(rows, labels, *, left=False):
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    lab = torch.full((len(rows), longest), -100)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for k, (row, label) in enumerate(zip(rows, labels)):
        at = slice(longest - len(row), longest) if left else slice(0, len(row))
        ids[k, at], lab[k, at], mask[k, at] = row, label, 1
    return {'input_ids': ids, 'labels': lab, 'attention_mask': mask}


def model_of(path, implementation):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation)


def rows_and_labels(vocab, lengths=(7, 12, 1, 5), seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (n, ), generator=generator) for n in lengths]
    labels = [r.clone() for r in rows]
    for label in labels:
        label[:2] = -100  # a prompt
    return rows, labels


def loss_and_grads(model, batch, num_items, backward=True):
    """The token-sum loss over ``num_items`` and, with ``backward``, the parameters' gradients (else ``None``)."""
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k != 'labels'}
    logits = model(**inputs).logits[0 if batch['input_ids'].shape[0] == 1 else slice(None)]
    labels = batch['labels'] if batch['input_ids'].shape[0] > 1 else batch['labels'][0]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]  # what transformers' loss does
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                                             ignore_index=-100, reduction='sum') / num_items
    if not backward:
        return loss.detach(), None
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize('implementation', ['sdpa', 'eager'])
@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
@pytest.mark.parametrize('left', [False, True])
def test_packed_row_has_the_padded_loss_and_gradient(arch, implementation, left, tiny_qwen, tiny_llama):
    model = model_of(tiny_qwen if arch == 'qwen2' else tiny_llama, implementation)
    rows, labels = rows_and_labels(model.config.vocab_size)
    padded = padded_batch(rows, labels, left=left)
    flat = flatten_rows(padded)
    assert flat['input_ids'].shape == (1, sum(len(r) for r in rows)) and 'attention_mask' not in flat
    assert flat['position_ids'][0].tolist() == [p for r in rows for p in range(len(r))]
    assert flat['use_cache'] is False
    items = int((padded['labels'][:, 1:] != -100).sum())
    assert int((flat['labels'][:, 1:] != -100).sum()) == items  # the same (prediction, label) pairs
    loss_padded, grads_padded = loss_and_grads(model, padded, items)
    loss_flat, grads_flat = loss_and_grads(model, flat, items)
    assert float(loss_flat) == pytest.approx(float(loss_padded), rel=1e-6)
    assert len(grads_flat) == len(grads_padded) > 0
    assert max(float((a - b).abs().max()) for a, b in zip(grads_flat, grads_padded)) < 1e-5


@pytest.mark.parametrize('implementation', ['sdpa', 'eager'])
@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
def test_no_attention_across_packed_rows(arch, implementation, tiny_qwen, tiny_llama):
    model = model_of(tiny_qwen if arch == 'qwen2' else tiny_llama, implementation).eval()
    rows, labels = rows_and_labels(model.config.vocab_size, lengths=(6, 9, 4))
    other = [(rows[0] + 3) % model.config.vocab_size, rows[1], (rows[2] + 5) % model.config.vocab_size]
    with torch.no_grad():
        a = model(**{k: v for k, v in flatten_rows(padded_batch(rows, labels)).items() if k != 'labels'}).logits
        b = model(**{k: v for k, v in flatten_rows(padded_batch(other, labels)).items() if k != 'labels'}).logits
    # row B (positions 6..14) is unchanged and must not see row A's change; row C changed
    assert torch.equal(a[0, 6:15], b[0, 6:15])
    assert not torch.allclose(a[0, 15:], b[0, 15:])
    check_packed_attention(model)  # the train-start proof passes on both architectures


class Mixing(torch.nn.Module):
    """A model that ignores position_ids: every token sees every earlier one, packed or not."""

    def __init__(self, implementation='sdpa'):
        super().__init__()
        self.config = type('Config', (), {'vocab_size': 16, '_attn_implementation': implementation})()
        self.embed = torch.nn.Embedding(16, 16)

    def forward(self, input_ids, position_ids=None, use_cache=None, **varlen):
        return type('Out', (), {'logits': self.embed(input_ids).cumsum(dim=1)})()


def test_the_train_start_proof_refuses_what_would_mix_rows():
    for implementation in ('sdpa', 'flex_attention', 'flash_attention_2'):
        with pytest.raises(ConfigError, match='attends across rows'):
            check_packed_attention(Mixing(implementation))
    with pytest.raises(ConfigError, match="got 'paged_attention'"):
        check_packed_attention(Mixing('paged_attention'))


@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
def test_flex_attention_packed_row_has_the_padded_loss(arch, tiny_qwen, tiny_llama):
    """flex_attention (compiled; forward only on CPU): the packed row, filled up to a multiple of 128 tokens, gives
    the padded sdpa batch's loss; lengths of 8 + 16 k tokens, where torch 2.13's CPU kernel is wrong unfilled."""
    path = tiny_qwen if arch == 'qwen2' else tiny_llama
    padded_model, flex_model = model_of(path, 'sdpa'), model_of(path, 'flex_attention')
    for lengths in ((7, 12, 1, 5), (24, 40, 8), (100, 60)):
        rows, labels = rows_and_labels(padded_model.config.vocab_size, lengths=lengths)
        padded = padded_batch(rows, labels)
        flat = flatten_rows(padded, 'flex_attention')
        tokens = sum(lengths)
        assert flat['input_ids'].shape[1] % FLEX_BLOCK == 0 and flat.fill == flat['input_ids'].shape[1] - tokens
        assert flat['position_ids'][0, tokens:].tolist() == list(range(flat.fill))  # a row of its own
        assert (flat['labels'][0, tokens:] == -100).all()
        items = int((padded['labels'][:, 1:] != -100).sum())
        with torch.no_grad():
            loss_padded, _ = loss_and_grads(padded_model, padded, items, backward=False)
            loss_flex, _ = loss_and_grads(flex_model, flat, items, backward=False)
        assert float(loss_flex) == pytest.approx(float(loss_padded), rel=1e-5), lengths
    check_packed_attention(flex_model)
    from torch._dynamo.utils import counters
    compiled = counters['frames']['ok']
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):  # packed rows of other lengths: the kernels compiled for dynamic lengths serve them all
        lengths = torch.randint(1, 200, (int(torch.randint(1, 6, (1, ), generator=generator)), ),
                                generator=generator).tolist()
        rows, labels = rows_and_labels(padded_model.config.vocab_size, lengths=[n + 129 for n in lengths])
        flat = flatten_rows(padded_batch(rows, labels), 'flex_attention')
        with torch.no_grad():
            flex_model(**{k: v for k, v in flat.items() if k != 'labels'})
    assert counters['frames']['ok'] == compiled  # no new compile


def varlen_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """flash attention's varlen call, in plain torch: attention within each row of ``cu_seq_lens_q``, which must be
    given (the pack's boundaries; transformers would otherwise find them from the positions on the device)."""
    bounds = kwargs['cu_seq_lens_q'].tolist()
    assert kwargs['cu_seq_lens_k'].tolist() == bounds and attention_mask is None
    assert kwargs['max_length_q'] == max(b - a for a, b in zip(bounds, bounds[1:]))
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
        for a, b in zip(bounds, bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
def test_flash_varlen_packed_row_has_the_padded_loss_and_gradient(arch, tiny_qwen, tiny_llama, monkeypatch):
    """The flash path without flash-attn: a stand-in varlen kernel registered as flash_attention_2 gets the rows'
    boundaries the pack computed on the host (the same as transformers derives from the positions) and gives the
    padded batch's loss and gradient, also for the pieces of a split."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, 'flash_attention_2', varlen_stand_in)
    assert 'flash_attention_2' in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    path = tiny_qwen if arch == 'qwen2' else tiny_llama
    padded_model = model_of(path, 'sdpa')
    varlen_model = model_of(path, 'sdpa')
    varlen_model.config._attn_implementation_internal = 'flash_attention_2'  # flash-attn itself is not installed
    rows, labels = rows_and_labels(padded_model.config.vocab_size, lengths=(7, 12, 1, 5, 9))
    padded = padded_batch(rows, labels)
    flat = flatten_rows(padded, 'flash_attention_2')
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(flat['position_ids'])
    assert flat['cu_seq_lens_q'].tolist() == cu_q.tolist() == [0, 7, 19, 20, 25, 34]
    assert flat['max_length_q'] == int(max_q) == 12 and flat.fill == 0
    items = int((padded['labels'][:, 1:] != -100).sum())
    loss_padded, grads_padded = loss_and_grads(padded_model, padded, items)
    loss_flat, grads_flat = loss_and_grads(varlen_model, flat, items)
    assert float(loss_flat) == pytest.approx(float(loss_padded), rel=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(grads_flat, grads_padded)) < 1e-5
    pieces = split_packed(flat, 2)
    assert [p['cu_seq_lens_q'].tolist() for p in pieces] == [[0, 7, 19, 20], [0, 5, 14]]
    loss_pieces = sum(loss_and_grads(varlen_model, p, items)[0] for p in pieces)
    assert float(loss_pieces) == pytest.approx(float(loss_padded), rel=1e-5)
    check_packed_attention(varlen_model)


def test_flex_filler_is_cut_off_and_added_again_at_a_split():
    rows = [torch.arange(1, n + 1) for n in (50, 70, 30, 9)]
    batch = padded_batch(rows, [r.clone() for r in rows])
    batch['loss_scale'] = batch['attention_mask'].float()
    flat = flatten_rows(batch, 'flex_attention')
    assert flat['input_ids'].shape == (1, 256) and flat.fill == 256 - 159 and flat.attention == 'flex_attention'
    assert flat['loss_scale'][0, 159:].sum() == 0
    pieces = split_packed(flat, 2)
    assert [p.row_lengths for p in pieces] == [(50, 70), (30, 9)]
    assert [p['input_ids'].shape[1] for p in pieces] == [128, 128] and [p.fill for p in pieces] == [8, 89]
    for piece in pieces:
        tokens = sum(piece.row_lengths)
        assert all(v.shape[1] == 128 for v in piece.values() if isinstance(v, torch.Tensor))
        assert (piece['labels'][0, tokens:] == -100).all() and piece['position_ids'][0, tokens] == 0
    real = torch.cat([p['input_ids'][:, :sum(p.row_lengths)] for p in pieces], dim=1)
    assert torch.equal(real, flat['input_ids'][:, :159])
    from swift_dynamic_callbacks.data.slots import PassGroup
    from swift_dynamic_callbacks.integrations.inputs import prepare_slot
    ready = prepare_slot(PassGroup([batch, batch]), padding_free=True, attention='flex_attention', device=None)
    assert [p.fill for p in ready.passes] == [97, 97]  # the runner hands its attention to every pass of a step
    plain = flatten_rows(batch)
    assert isinstance(plain, PackedBatch) and plain['input_ids'].shape == (1, 159) and 'cu_seq_lens_q' not in plain


def machine(flash=None, flex=True):
    """What :func:`~swift_dynamic_callbacks.integrations.attention.installed_kernels` finds: ``flash`` installed
    (``None``: no flash-attn), ``flex`` available."""
    return {'flash': (flash, ) if flash else (), 'flex': ('flex_attention', ) if flex else (), 'sdpa': ('sdpa', )}


def test_the_best_packed_attention():
    def best(current, mode, cuda, **found):
        return best_packed_attention(current, mode=mode, cuda=cuda, installed=machine(**found))
    assert best('sdpa', 'auto', True, flash='flash_attention_2')[0] == 'flash_attention_2'
    assert best('sdpa', 'auto', True) == ('flex_attention', 'flash-attn is not installed: flex_attention skips the '
                                          'masked blocks between rows (sdpa computes all N^2 pairs)')
    assert best('sdpa', 'auto', True, flex=False) == ('sdpa', 'neither flash-attn nor flex_attention is available')
    assert best('sdpa', 'auto', False) == (  # no flex backward on CPU
        'sdpa', 'not on CUDA (flex_attention has no backward on CPU; flash-attn needs CUDA)')
    assert best('eager', 'auto', True, flash='flash_attention_2')[0] == 'eager'  # chosen
    assert best('sdpa', 'keep', True, flash='flash_attention_2')[0] == 'sdpa'


def test_explicit_packed_attention_modes_or_a_reason():
    def best(current, mode, cuda, **found):
        return best_packed_attention(current, mode=mode, cuda=cuda, installed=machine(**found))
    assert best('eager', 'sdpa', False) == ('sdpa', 'integration.packed_attention: sdpa')
    assert best('sdpa', 'flash', True, flash='flash_attention_3')[0] == 'flash_attention_3'
    assert best('eager', 'flex', True)[0] == 'flex_attention'
    with pytest.raises(ConfigError, match='packed_attention: flash needs CUDA and flash-attn installed .got no '
                                          'flash-attn.; allowed here: auto, sdpa, keep, flex$'):
        best('sdpa', 'flash', True)
    with pytest.raises(ConfigError, match='packed_attention: flash needs .* .got no CUDA device.; allowed here: auto, '
                                          'sdpa, keep$'):
        best('sdpa', 'flash', False, flash='flash_attention_2')
    with pytest.raises(ConfigError, match='packed_attention: flex needs CUDA .* no CUDA device: flex_attention has no '
                                          'backward on CPU.; allowed here: auto, sdpa, keep$'):
        best('sdpa', 'flex', False)


def test_every_backend_has_a_setting_and_every_setting_a_backend():
    """``integrations/attention/``: one backend per name of ``config/integration.py`` (the settings stay torch-free),
    each claiming its implementations; ``auto`` ranks flash before flex and never switches to sdpa."""
    from swift_dynamic_callbacks.config.integration import ATTENTION_BACKENDS, PACKED_ATTENTION
    from swift_dynamic_callbacks.integrations.attention import BACKENDS, SUPPORTED_ATTENTION, auto_order, backend_for
    assert tuple(BACKENDS) == ATTENTION_BACKENDS and PACKED_ATTENTION == ('auto', 'flash', 'flex', 'sdpa', 'keep')
    assert SUPPORTED_ATTENTION == ('sdpa', 'eager', 'flex_attention', 'flash_attention_2', 'flash_attention_3',
                                   'flash_attention_4')
    assert all(backend_for(name) is BACKENDS[b] for b in BACKENDS for name in BACKENDS[b].implementations)
    assert [b.name for b in auto_order()] == ['flash', 'flex']
    assert backend_for('paged_attention').finish(PackedBatch({'input_ids': torch.ones(1, 3)}, [3]), 'x').fill == 0


@pytest.mark.parametrize('implementation', ['sdpa', 'eager', 'flex_attention', 'flash_attention_2', 'unclaimed'])
def test_a_finished_row_gives_its_packed_rows_back(implementation):
    """Whatever a backend adds (flex's filler, flash's boundaries) :func:`packed_rows_only` takes off again."""
    from swift_dynamic_callbacks.integrations.attention import finish_packed
    rows = [torch.arange(1, n + 1) for n in (5, 3)]
    batch = flatten_rows(padded_batch(rows, [r.clone() for r in rows]))
    finished = finish_packed(batch, implementation)
    assert finished.attention == implementation and finished.row_lengths == (5, 3)
    plain = packed_rows_only(finished)
    assert set(plain) == set(batch) and all(torch.equal(plain[k], v) for k, v in batch.items()
                                            if isinstance(v, torch.Tensor))
    if implementation == 'flash_attention_2':
        assert finished['cu_seq_lens_q'].tolist() == [0, 5, 8] and finished['max_length_k'] == 5


def test_auto_tries_the_next_installed_kernel_after_a_failure(monkeypatch):
    """On CUDA with flash attention 3 and 2 installed, a broken FA3 build falls to FA2 (then flex), not to sdpa; every
    kernel tried is one agreement of the ranks (faked here: the proofs need a GPU)."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.integrations import packed_attention
    tried, switched = [], []
    base = SimpleNamespace(set_attn_implementation=switched.append)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation='sdpa'),
                            parameters=lambda: iter([SimpleNamespace(device=torch.device('cuda'))]))
    from swift_dynamic_callbacks.integrations.attention import flash
    monkeypatch.setattr(flash, 'installed_flash_attentions', lambda: ['flash_attention_3', 'flash_attention_2'])
    monkeypatch.setattr(packed_attention, 'transformers_model', lambda m: base)
    monkeypatch.setattr(packed_attention, '_try_kernel', lambda m, b, kernel, *a: tried.append(kernel) or (
        'ImportError: broken build' if kernel == 'flash_attention_3' else None))
    chosen = use_packed_attention(model, 'auto')
    assert tried == ['flash_attention_3', 'flash_attention_2'] and chosen['new'] == 'flash_attention_2'
    assert chosen['why'].startswith('flash_attention_3 failed (ImportError: broken build); flash_attention_2 passed')
    assert switched == ['sdpa']  # FA3 undone before FA2 was tried


def test_a_kernel_that_fell_back_on_one_rank_is_left_on_every_rank(monkeypatch):
    """Mid-run, rank 1's kernel failed and it fell back; at the next boundary every rank has every rank's records
    (``requests.merge_step``), and a rank still on the kernel falls back too: the ranks run one kernel again."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.integrations import packed_attention
    from swift_dynamic_callbacks.integrations.requests import merge_step
    from swift_dynamic_callbacks.protocol import BatchRequest
    from swift_dynamic_callbacks.records import DecisionRecord
    switched = []
    monkeypatch.setattr(packed_attention, 'transformers_model',
                        lambda m: SimpleNamespace(set_attn_implementation=switched.append))
    rank0 = packed_attention.PackedAttention('auto')
    rank0.kernel, rank0.original = 'flash_attention_2', 'sdpa'
    failed = DecisionRecord('integration', 'packed_attention', 'fallback',
                            {'old': 'flash_attention_2', 'new': 'sdpa', 'rank': 1, 'error': 'RuntimeError: boom'})
    oom = DecisionRecord('integration', 'oom', 'recovered', {'rank': 0, 'pass_tokens': 900})
    _, shared = merge_step([(BatchRequest(), [oom]), (BatchRequest(), [failed])])
    assert shared == [oom, failed]
    assert rank0.follow(None, [oom], 3) is None  # nothing failed: stays
    record = rank0.follow(None, shared, 3)
    assert record.reason == 'follow' and record.values['new'] == 'sdpa' and 'rank 1: RuntimeError: boom' in (
        record.values['error'])
    assert switched == ['sdpa'] and rank0.kernel == 'sdpa' and not rank0.switched
    assert rank0.follow(None, shared, 4) is None  # already on it


def test_an_explicit_kernel_that_fails_its_proof_is_refused(tiny_qwen, monkeypatch):
    from swift_dynamic_callbacks.integrations import packed_attention
    model = model_of(tiny_qwen, 'sdpa')
    monkeypatch.setattr(packed_attention, 'best_packed_attention', lambda *a, **k: ('flex_attention', 'test'))
    # On a CPU flex fails its proof: no flex backward there (NotImplementedError), or, on some CPUs, torch 2.13's
    # inductor emits C++ for flex's dynamic-shape CPU template that does not compile (CppCompileError) first.
    with pytest.raises(ConfigError, match=r'packed_attention: flex .flex_attention. failed its proof on this model '
                                          r'\((NotImplementedError|InductorError)'):
        use_packed_attention(model, 'flex')  # refused, not silently replaced
    assert model.config._attn_implementation == 'sdpa'


def test_the_backward_proof_runs_in_train_mode_under_reentrant_checkpointing(tiny_qwen):
    """ms-swift checkpoints with use_reentrant=True in one process, and torch refuses autograd.grad through those:
    the proof runs a real backward in train mode instead, and puts the gradients (and the random state) back."""
    from peft import LoraConfig, get_peft_model

    from swift_dynamic_callbacks.integrations.packed_attention import check_packed_backward
    model = get_peft_model(model_of(tiny_qwen, 'sdpa'), LoraConfig(r=2, target_modules='all-linear',
                                                                    lora_dropout=0.1))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})
    model.enable_input_require_grads()
    model.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable[:3]:
        p.grad = torch.full_like(p, 0.5)
    state = torch.get_rng_state()
    check_packed_backward(model, 'sdpa')
    assert not model.training  # the mode it was in
    assert torch.equal(torch.get_rng_state(), state)  # dropout drew from a forked generator
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in trainable[:3])
    assert all(p.grad is None for p in trainable[3:])
    embeds_only = model_of(tiny_qwen, 'sdpa').requires_grad_(False)  # nothing trainable: the input embeddings' grad
    check_packed_backward(embeds_only, 'sdpa')


def test_flex_is_compiled_once_for_train_and_eval():
    from transformers.integrations.flex_attention import WrappedFlexAttention

    from swift_dynamic_callbacks.integrations.attention.flex import keep_flex_compiled
    assert keep_flex_compiled() and keep_flex_compiled()  # idempotent
    first = WrappedFlexAttention(True)()
    assert WrappedFlexAttention(False)() is first and WrappedFlexAttention(True)() is first


def test_a_kernel_that_fails_is_undone_and_said(tiny_qwen, monkeypatch):
    from swift_dynamic_callbacks.integrations import packed_attention as padding_free
    model = model_of(tiny_qwen, 'sdpa')
    assert use_packed_attention(model, 'auto') == {
        'old': 'sdpa', 'new': 'sdpa',
        'why': 'not on CUDA (flex_attention has no backward on CPU; flash-attn needs CUDA)'}
    monkeypatch.setattr(padding_free, 'best_packed_attention', lambda *a, **k: ('flash_attention_2', 'test'))
    chosen = use_packed_attention(model, 'auto')  # flash-attn is not installed: loading it fails
    assert chosen['new'] == 'sdpa' and chosen['why'].startswith('flash_attention_2 failed (')
    assert model.config._attn_implementation == 'sdpa'
    monkeypatch.setattr(padding_free, 'best_packed_attention', lambda *a, **k: ('flex_attention', 'test'))
    chosen = use_packed_attention(model, 'auto')  # its forward runs on CPU, its backward does not: caught up front
    # no flex backward on a CPU; or, on some CPUs once flex is compiled with dynamic shapes, torch 2.13's inductor
    # emits C++ for its CPU template that does not compile
    why = chosen['why']
    assert chosen['new'] == 'sdpa' and model.config._attn_implementation == 'sdpa'
    assert (why.startswith('flex_attention failed (NotImplementedError') and 'backward' in why) or why.startswith(
        'flex_attention failed (InductorError: CppCompileError'), why
    assert all(p.grad is None for p in model.parameters())  # the backward probe leaves the gradients alone
    forward_only = use_packed_attention(model, 'auto', probe_backward=False)['new']  # the forward proof only: flex
    flex_compiles = 'CppCompileError' not in why  # unless its forward does not compile here either
    assert forward_only == model.config._attn_implementation == ('flex_attention' if flex_compiles else 'sdpa')
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(model_of(tiny_qwen, 'sdpa'), LoraConfig(r=2, target_modules='all-linear'))
    monkeypatch.setattr(padding_free, 'best_packed_attention', lambda *a, **k: ('eager', 'test'))
    assert use_packed_attention(lora, 'auto')['new'] == 'eager'  # switched inside PEFT, both proofs passed
    assert lora.get_base_model().config._attn_implementation == 'eager'
    assert all(p.grad is None for p in lora.parameters())
    monkeypatch.setattr(padding_free, 'check_packed_attention', lambda *a: None)
    chosen = use_packed_attention(Mixing('sdpa'), 'auto')  # no transformers model to switch: kept, said
    assert chosen['new'] == 'sdpa' and chosen['why'].startswith('no transformers model inside Mixing')


def test_flatten_refuses_what_it_cannot_flatten():
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    batch = padded_batch(rows, [r.clone() for r in rows])
    batch['pixel_values'] = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="'pixel_values'"):
        flatten_rows(batch)
    batch.pop('pixel_values')
    batch['position_ids'] = torch.zeros(3, 2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match='position_ids of shape'):
        flatten_rows(batch)


def test_padding_free_token_budget_counts_real_tokens():
    plan = BatchPlan(max_tokens=100, padding_free=True, bucketing=False)
    lengths = [10, 90, 5, 60, 30, 150, 1, 1]
    sizes = greedy_pieces(lengths, plan)
    at = 0
    for size in sizes:
        piece = lengths[at:at + size]
        assert sum(piece) <= 100 or size == 1
        at += size
    assert sizes == [2, 3, 1, 2]  # 10+90 | 5+60+30 | 150 (alone, over) | 1+1
    assert greedy_pieces(lengths, BatchPlan(max_tokens=100, bucketing=False)) != sizes  # padded: n x longest


def stand_in_flash(monkeypatch, kernel):
    """``kernel`` as flash_attention_2, which ``packed_attention: auto`` then chooses (no flash-attn check on CPU)."""
    from transformers import PreTrainedModel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from swift_dynamic_callbacks.integrations import packed_attention
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, 'flash_attention_2', kernel)
    monkeypatch.setattr(packed_attention, 'best_packed_attention', lambda *a, **k: ('flash_attention_2', 'test'))
    monkeypatch.setattr(PreTrainedModel, 'set_attn_implementation',
                        lambda self, name: setattr(self.config, '_attn_implementation_internal', name))


def balanced_run(out, model, data, padding_free, **integration):
    """One epoch of balanced steps (3 x GA 1, LoRA dropout 0) on the tiny LLaMA, padded or padding-free."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_runs import run_sft
    try:
        sdc.register(length_batching={'mode': 'balanced', 'padding_free': padding_free}, integration=integration)
        return run_sft(model, 'llama', data, str(out), callbacks=['length_batching'], max_steps=-1,
                       num_train_epochs=1, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                       max_length=2048, lora_dropout=0.0, attn_impl='sdpa')
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_swift_sft_padding_free_trains_as_the_padded_run(tmp_path, tiny_llama, monkeypatch):
    """Real swift sft runs, the same samples a step: padded; padding-free on sdpa (auto keeps it on CPU); padding-free
    switched by auto to flash attention, here the stand-in varlen kernel (flash-attn needs CUDA), which fails unless the
    rows' boundaries reach it through ms-swift's trainer and PEFT. The same loss at every step."""

    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, sample_trace, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=12))
    runs, calls = {}, []

    def counted(*args, **kwargs):
        calls.append(kwargs['cu_seq_lens_q'].tolist())
        return varlen_stand_in(*args, **kwargs)

    for variant in ('padded', 'sdpa', 'varlen'):
        if variant == 'varlen':
            stand_in_flash(monkeypatch, counted)
        runs[variant] = balanced_run(tmp_path / f'out-{variant}', tiny_llama, data, variant != 'padded',
                                     record_samples=True)
    padded = train_logs(runs['padded'])
    assert len(padded) == 4
    for variant in ('sdpa', 'varlen'):
        packed = train_logs(runs[variant])
        trace = [r['batches'] for r in sample_trace(runs[variant])]
        assert trace == [r['batches'] for r in sample_trace(runs['padded'])]
        assert len(packed) == 4
        for a, b in zip(padded, packed):
            assert b['loss'] == pytest.approx(a['loss'], rel=1e-4), variant  # the same samples, the same gradients
            assert b['dynamic/padding_fraction'] == 0.0 and a['dynamic/padding_fraction'] > 0
        assert packed[-1]['dynamic/padded_tokens_seen'] == packed[-1]['dynamic/tokens_seen']
        [plan] = [d for d in decisions(runs[variant]) if d['kind'] == 'batch_plan']
        assert 'padding-free' in plan['message']
        [attention] = [d for d in decisions(runs[variant]) if d['kind'] == 'packed_attention']
        assert attention['values']['mode'] == 'auto'
        assert attention['reason'] == {'sdpa': 'sdpa', 'varlen': 'flash_attention_2'}[variant]  # CPU: sdpa stays
    assert not [d for d in decisions(runs['padded']) if d['kind'] == 'packed_attention']
    assert len(calls) >= 4 * 2 and all(len(bounds) >= 2 for bounds in calls)  # 4 steps x 2 layers, forward


def test_the_start_up_proof_script_passes_and_can_fail(tmp_path, monkeypatch, capsys):
    """``scripts/packed_proof.py`` (run on a GPU before the throughput arms): on the tiny model the packed forms give
    the padded loss and gradient; a packing that lets rows see each other (positions not restarted) is caught."""
    from benchmarks import packed_proof as proof
    from swift_dynamic_callbacks.integrations import padding_free
    common = ['--model', 'tiny', '--attentions', 'sdpa', 'eager', '--work', str(tmp_path), '--lengths', '9', '40', '3']
    jsonl = tmp_path / 'proof.jsonl'
    assert proof.main([*common, '--jsonl', str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert '| sdpa |' in out and '| eager |' in out and 'DIFFERENT' not in out and 'noise floor' in out
    lines = [json.loads(x) for x in jsonl.read_text(encoding='utf-8').splitlines()]
    # fp32: padded batches alone agree far below the tolerance, which stays the fp32 one
    assert all(x['floor'][1] < 1e-5 and x['tolerance'] == [1e-4, 1e-3] for x in lines)
    right = padding_free.flatten_rows

    def one_sequence(batch, attention='sdpa'):
        packed = right(batch, attention)
        packed['position_ids'] = torch.arange(packed['input_ids'].shape[1])[None]  # one long row: rows mix
        return packed

    monkeypatch.setattr(padding_free, 'flatten_rows', one_sequence)
    assert proof.main(common) == 1
    assert 'DIFFERENT' in capsys.readouterr().out
    # padded batches that disagree among themselves as much (a noise floor of 100 %) leave nothing to judge by
    monkeypatch.setattr(proof, 'noise_floor', lambda *args: (1.0, 1.0))
    assert proof.main(common) == 0


@pytest.mark.e2e
def test_swift_sft_a_kernel_failing_mid_run_falls_back_to_sdpa(tmp_path, tiny_llama, monkeypatch):
    """A switched packed-attention kernel (the stand-in varlen kernel as flash_attention_2) that fails in the third
    training step (not an OOM): the step runs again on sdpa, a ``packed_attention`` ``fallback`` record says why, the
    run finishes with the padded run's losses, and nothing is taken for an OOM."""

    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=12))
    calls = []

    def failing(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        if len(calls) == 11:  # proofs: 2 x 2 eval + 2 train calls; steps 1-2: 4 calls; step 3's first layer
            raise RuntimeError('CUDA error: an illegal memory access was encountered (stand-in kernel)')
        return varlen_stand_in(*args, **kwargs)

    runs = {}
    for variant in ('padded', 'failing'):
        if variant == 'failing':
            stand_in_flash(monkeypatch, failing)
        runs[variant] = balanced_run(tmp_path / f'out-{variant}', tiny_llama, data, variant != 'padded')
    assert len(calls) == 11  # after the failure the kernel is never called again
    padded, failed = train_logs(runs['padded']), train_logs(runs['failing'])
    assert [r['loss'] for r in failed] == pytest.approx([r['loss'] for r in padded], rel=1e-4)
    assert failed[-1]['dynamic/oom_count'] == 0
    records = [d for d in decisions(runs['failing']) if d['kind'] == 'packed_attention']
    assert [d['reason'] for d in records] == ['flash_attention_2', 'fallback']
    assert records[1]['values']['old'] == 'flash_attention_2' and records[1]['values']['new'] == 'sdpa'
    assert 'illegal memory access' in records[1]['values']['error']
