"""Which attention packed rows run with, the proof that it keeps them apart, and the fall-back when it fails.

``integration.packed_attention`` (with ``length_batching.padding_free``):

- ``auto`` (default): a model on sdpa (the default nobody chose for packing) moves to the best kernel the machine has
  for packed rows: flash-attn's varlen kernel where it is installed, else ``flex_attention`` on CUDA; on a CPU sdpa
  stays. A kernel that fails to load or a proof is undone and said in the record.
- ``flash`` / ``flex`` / ``sdpa``: that backend (``flash``: the installed flash attention 3 or 2). Unavailable, or
  failing its proof, it is refused at start with the reason (an explicit choice is never silently replaced).
- ``keep``: the model's own attention.

The backends (whether each can run here, what a packed row needs added for it, ``auto``'s ranking) are
:mod:`.attention`'s, one module a backend; this module is the same for all of them.

:class:`PackedAttention` (the integration's part) chooses (:func:`best_packed_attention`, pure), switches the
transformers model inside any wrapper, and proves the choice before training: :func:`check_packed_attention` (two rows
run packed; changing the first must not change the second's logits) and, where backward holds no collectives,
:func:`check_packed_backward` (a real forward and backward in train mode, as training runs it — under gradient
checkpointing too — the trainable parameters' gradients put back after it; for flex two lengths, so its kernels are
compiled for training with dynamic lengths before step 1). The ranks agree: a kernel is used only where it passed on
every rank (every check's failure, the model's own attention's included, goes through one exchange, so no rank
raises while another waits). During training a non-OOM error in a pass on a switched kernel (a compile or kernel
failure at a new shape; ``flex_attention`` running uncompiled, which would materialise ``N x N`` scores, is turned
into such an error inside the training passes only: :meth:`PackedAttention.training_pass`) falls back to the model's
own attention with a record, and the step is run again (:meth:`PackedAttention.fall_back`). The fallback is saved with
the checkpoint: a resumed run keeps the model's own attention and does not prove the failed kernel again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ContextManager, Mapping, Sequence

import torch

from .. import distributed
from ..config import ConfigError
from ..records import DecisionRecord
from .attention import BACKENDS, SUPPORTED_ATTENTION, PackedBatch, auto_order, backend_for, finish_packed, \
    installed_kernels

logger = logging.getLogger('swift_dynamic_callbacks')

SETTING = 'dynamic_callbacks.integration.packed_attention'
#: the attention ``auto`` switches from (the default nobody chose for packing); any other the model runs is kept
SWITCHED_FROM = 'sdpa'


def attention_implementation(model: Any) -> str | None:
    config = getattr(model, 'config', None)
    return getattr(config, '_attn_implementation', None) or getattr(config, 'attn_implementation', None)


def best_packed_attention(current: str | None, *, mode: str, cuda: bool,
                          installed: Mapping[str, Sequence[str]]) -> tuple[str | None, str]:
    """The attention implementation packed rows should run with, and why (pure). ``mode``: ``keep`` (the model's),
    a backend of :data:`~.attention.BACKENDS` (its best installed implementation; refused with the reason when it
    cannot run here), ``auto`` (switch from :data:`SWITCHED_FROM` to the best-ranked backend ready here: flash, else
    flex on CUDA; an implementation the user chose is kept). ``cuda``: the model is on a CUDA device; ``installed``:
    every backend's implementations that load here, best first (:func:`~.attention.installed_kernels`).

    Raises:
        ConfigError: an explicit backend that this machine cannot run.
    """
    if mode == 'keep':
        return current, 'integration.packed_attention: keep'
    ready = [b for b in BACKENDS.values() if b.missing(cuda, installed.get(b.name, ())) is None]
    if mode in BACKENDS:
        missing = BACKENDS[mode].missing(cuda, installed.get(mode, ()))
        if missing is not None:
            allowed = ['auto', *(b.name for b in ready if b.preference is None), 'keep',
                       *(b.name for b in auto_order() if b in ready and b.name != mode)]
            raise ConfigError(f'{SETTING}: {mode} {missing}; allowed here: {", ".join(allowed)}')
        return installed[mode][0], f'integration.packed_attention: {mode}'
    if current != SWITCHED_FROM:
        return current, f'the model runs {current} (only {SWITCHED_FROM} is switched)'
    best = next((b for b in auto_order() if b in ready), None)
    if best is not None:
        return installed[best.name][0], best.auto_why
    if not cuda:
        return current, f'not on CUDA ({"; ".join(b.off_cuda for b in reversed(auto_order()))})'
    return current, f'neither {" nor ".join(b.label for b in auto_order())} is available'


def transformers_model(model: Any) -> Any:
    """The outermost transformers model in ``model`` (itself, or inside PEFT / ms-swift wrappers), or ``None``."""
    from transformers import PreTrainedModel
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return next((m for m in modules if isinstance(m, PreTrainedModel)), None)


def probe_rows(model: Any, attention: str, shift: int, length: int = 4) -> PackedBatch:
    """Two packed rows of ``length`` tokens on the model's device, finished for ``attention``: the second is always
    the same, the first is the second's tokens moved by ``shift`` (the train-start proofs' input)."""
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, 'config', None), 'vocab_size', 0) or 32)
    second = torch.arange(1, length + 1, device=device) % vocab
    values = {'input_ids': torch.cat([(second + shift) % vocab, second])[None],
              'position_ids': torch.arange(length, device=device).repeat(2)[None]}
    return finish_packed(PackedBatch(values, (length, length)), attention)


def check_packed_backward(model: Any, attention: str) -> None:
    """A forward and backward of two packed rows finished for ``attention`` (:func:`probe_rows`) in train mode, as
    training runs them (gradient checkpointing included), so a kernel that cannot run backward here (flex attention
    on CPU, a compile that fails, attention dropout flex refuses in training) fails now, before training. The trainable
    parameters' gradients are put back as they were and the random state is restored (dropout draws nothing from the
    run's generators). For flex two lengths (one and two blocks of 128), so its training kernels are compiled, for
    dynamic lengths, before the first step."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    devices = [next(model.parameters()).device] if next(model.parameters()).device.type == 'cuda' else []
    was_training = model.training
    lengths = backend_for(attention).probe_lengths
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            for length in lengths:
                for p in params:
                    p.grad = None
                batch = dict(probe_rows(model, attention, 7, length))
                if params:
                    model(**batch, use_cache=False).logits.float().sum().backward()
                else:  # nothing trainable: the gradient to the input embeddings only
                    embeds = model.get_input_embeddings()(batch.pop('input_ids')).detach().requires_grad_(True)
                    logits = model(inputs_embeds=embeds, **batch, use_cache=False).logits
                    torch.autograd.grad(logits.float().sum(), embeds)
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad
        model.train(was_training)


def check_packed_attention(model: Any, setting: str = 'length_batching.padding_free') -> None:
    """Refuse padding-free micro-batches where the model would attend across packed rows: an attention
    implementation outside :data:`~.attention.SUPPORTED_ATTENTION`, or a model whose second row's logits change with
    the first row's tokens (two tiny forwards of :func:`probe_rows` finished for the model's attention, in eval mode,
    on the model's device; causal attention never lets the first row see the second, so the second is the one to watch).
    On CUDA the forwards run with gradients enabled, as training runs them (grad mode is part of a compiled kernel's
    guards: a no-grad check would compile a graph training never uses); nothing is backpropagated."""
    implementation = attention_implementation(model)
    if implementation not in SUPPORTED_ATTENTION:
        raise ConfigError(f'{setting}: true needs attn_impl {" / ".join(SUPPORTED_ATTENTION)} (got '
                          f'{implementation!r}): those keep packed rows apart by position_ids in transformers')

    grad = next(model.parameters()).device.type == 'cuda'  # a CPU cannot run flex's backward: no training there

    def logits(shift: int) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return model(**probe_rows(model, implementation, shift), use_cache=False).logits[0, 4:8].float().detach()

    was_training = model.training
    model.eval()
    try:
        a, b = logits(7), logits(11)
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, atol=1e-5, rtol=1e-4):
        raise ConfigError(f'{setting}: this model ({type(model).__name__}, attn_impl {implementation}) attends '
                          'across rows packed by position_ids (the second row\'s logits changed with the first '
                          'row\'s tokens), so padding-free micro-batches would mix samples; use padding_free: false')


def _agreed_check(model: Any, setting: str) -> None:
    """:func:`check_packed_attention` on every rank, its outcome exchanged: every rank raises the first rank's
    refusal (no rank raises while another waits in a collective)."""
    failure = None
    try:
        check_packed_attention(model, setting)
    except ConfigError as error:
        failure = str(error)
    failures = [f for f in distributed.gather_objects(failure) if f is not None]
    if failures:
        raise ConfigError(failures[0] + ('' if failure is not None else ' (on another rank)'))


def _try_kernel(model: Any, base: Any, kernel: str, setting: str, probe_backward: bool) -> str | None:
    """Switch to ``kernel`` and prove it on this rank; the failure (``None``: it passed). Collective: every rank
    learns every rank's outcome and returns the first failure of any."""
    failure = None
    try:
        backend_for(kernel).prepare()
        base.set_attn_implementation(kernel)
        check_packed_attention(model, setting)
        if probe_backward:
            check_packed_backward(model, kernel)
    except Exception as error:  # noqa: BLE001 - any failure of a better kernel falls back, said in the record
        failure = f'{type(error).__name__}: {str(error)[:200]}'
    failures = [f for f in distributed.gather_objects(failure) if f is not None]  # every rank, every time
    if failures and failure is None:
        return f'{failures[0]} on another rank'
    return failures[0] if failures else None


def use_packed_attention(model: Any, mode: str, setting: str = 'length_batching.padding_free', *,
                         probe_backward: bool = True) -> dict[str, Any]:
    """Switch ``model`` (a transformers model, possibly inside PEFT) to :func:`best_packed_attention`'s choice and
    prove it keeps packed rows apart (:func:`check_packed_attention`) and, with ``probe_backward`` (engines whose
    backward holds no collectives), that it runs backward (:func:`check_packed_backward`). Every rank takes part in
    one agreement a kernel tried: it stays only where it passed on every rank. Under ``auto`` a kernel that failed
    is undone and the next candidate is tried (the other installed flash attention, then flex_attention on CUDA),
    then the model's own is proven; an explicit mode that fails is refused. Returns what was decided (``old``, ``new``,
    ``why``)."""
    old = attention_implementation(model)
    cuda = next(model.parameters()).device.type == 'cuda'
    installed = installed_kernels()
    new, why = best_packed_attention(old, mode=mode, cuda=cuda, installed=installed)
    base = transformers_model(model) if new != old else None
    if new != old and base is None:
        new, why = old, f'no transformers model inside {type(model).__name__} to switch to {new}; kept {old}'
    if new == old:
        _agreed_check(model, setting)
        return {'old': old, 'new': new, 'why': why}
    candidates = [new]
    if mode == 'auto' and cuda:  # the fallback chain: a broken FA3 build next to a working FA2 ends on FA2
        candidates += [k for b in auto_order() for k in installed[b.name] if k not in candidates]
    ranks = distributed.gather_objects(candidates)  # one chain for every rank: what every rank has, in rank 0's order
    candidates = [k for k in ranks[0] if all(k in other for other in ranks)]
    failed = []
    for kernel in candidates:
        failure = _try_kernel(model, base, kernel, setting, probe_backward)
        if failure is None:
            return {'old': old, 'new': kernel, 'why': why if kernel == new else
                    f'{"; ".join(failed)}; {kernel} passed (the next one installed)'}
        base.set_attn_implementation(old)
        if mode not in ('auto', 'keep'):
            raise ConfigError(f'{SETTING}: {mode} ({kernel}) failed its proof on this model ({failure}); allowed: '
                              'auto, sdpa, keep, or padding_free: false')
        failed.append(f'{kernel} failed ({failure})')
    _agreed_check(model, setting)
    return {'old': old, 'new': old, 'why': '; '.join(failed or ['no candidate every rank has'])
            + f'; kept {old}'}


class PackedAttention:
    """The attention packed rows run with (the integration's part; module docstring).

    Args:
        mode: ``integration.packed_attention``.

    State: ``kernel`` (what packed rows are finished for), ``original`` (the model's own before a switch) and
    ``fallen_back`` with the step it happened at: saved with the integration's, so a resumed run that had fallen
    back keeps the model's own attention (it does not prove the kernel that failed again).
    """

    def __init__(self, mode: str = 'auto') -> None:
        self.mode = mode
        self.kernel = 'sdpa'
        self.original: str | None = None
        self.fallen_back = False
        self.fallback_step: int | None = None
        self.fallback_error: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {'kernel': self.kernel, 'original': self.original, 'fallen_back': self.fallen_back,
                'fallback_step': self.fallback_step, 'fallback_error': self.fallback_error}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if not state:
            return
        self.fallen_back = bool(state.get('fallen_back'))
        self.fallback_step = state.get('fallback_step')
        self.fallback_error = state.get('fallback_error')
        if self.fallen_back:
            self.kernel, self.original = state.get('kernel') or self.kernel, state.get('original')

    def training_pass(self) -> ContextManager[None]:
        """Around one training pass: what the kernel's backend needs there (flex: running uncompiled, the whole
        ``N x N`` scores, is an error), unless it was fallen back from."""
        return contextlib.nullcontext() if self.fallen_back else backend_for(self.kernel).training_pass()

    @property
    def switched(self) -> bool:
        """Whether packed rows run on a kernel the pack switched the model to (one it can fall back from)."""
        return self.original is not None and self.kernel != self.original and not self.fallen_back

    def start(self, model: Any, *, probe_backward: bool, sharded: bool = False,
              setting: str = 'length_batching.padding_free') -> DecisionRecord:
        """Choose, switch and prove (collective); the ``packed_attention`` record. ``sharded`` (FSDP2, DeepSpeed:
        the forward holds collectives, so a proof failing on one rank would leave the others waiting): the model's
        own attention is kept (``auto``), an explicit kernel refused."""
        mode = self.mode
        if sharded and mode in BACKENDS:
            raise ConfigError(f'{SETTING}: {mode} is not supported under FSDP2 / DeepSpeed (their forward holds '
                              'collectives: a kernel proof failing on one rank would leave the others waiting); '
                              'allowed there: auto (the model\'s own attention is kept) or keep')
        if sharded:
            mode = 'keep'
        if self.fallen_back:  # resumed after a fallback: the model's own attention, the failed kernel not proven
            mode = 'keep'
        start = time.perf_counter()
        chosen = use_packed_attention(model, mode, setting, probe_backward=probe_backward)
        chosen['proof_s'] = round(time.perf_counter() - start, 3)
        if self.fallen_back:
            chosen['why'] = (f'resumed after the fallback at step {self.fallback_step} ({self.fallback_error}): the '
                             'model\'s own attention, as before the checkpoint')
            self.kernel = chosen['new']
            message = f'padding-free passes run with attn_impl {self.kernel}: {chosen["why"]}'
            logger.info(message)
            return DecisionRecord('integration', 'packed_attention', 'resumed_fallback',
                                  {**chosen, 'mode': self.mode}, message)
        if sharded and self.mode == 'auto':
            chosen['why'] = 'under FSDP2 / DeepSpeed the model\'s own attention is kept (a proof failing on one rank ' \
                            'would leave the others waiting in a collective)'
        self.kernel, self.original = chosen['new'], chosen['old']
        message = (f'padding-free passes run with attn_impl {chosen["new"]}' +
                   (f' (was {chosen["old"]})' if chosen['new'] != chosen['old'] else '') + f': {chosen["why"]} '
                   f'(chosen and proven in {chosen["proof_s"]:.1f} s, before step 1)')
        logger.info(message)
        return DecisionRecord('integration', 'packed_attention', chosen['new'], {**chosen, 'mode': self.mode},
                              message)

    def fall_back(self, model: Any, error: BaseException, step: int, *, reason: str = 'fallback') -> DecisionRecord:
        """After a non-OOM error in a pass on the switched kernel: the model's own attention from now on (this
        rank), the ``packed_attention`` record saying why (``reason`` ``follow``: another rank's failure, agreed at
        the step boundary). The caller finishes the step's batches for it again."""
        base = transformers_model(model)
        failed, self.kernel, self.fallen_back = self.kernel, self.original, True
        self.fallback_step, self.fallback_error = step, f'{failed}: {type(error).__name__}: {str(error)[:200]}'
        base.set_attn_implementation(self.kernel)
        if reason == 'follow':
            message = (f'{failed} failed on another rank ({str(error)[:300]}); this rank runs {self.kernel} too from '
                       f'this step on (rank {distributed.rank()})')
        else:
            message = (f'{failed} failed during training ({type(error).__name__}: {str(error)[:300]}); packed rows '
                       f'run with {self.kernel} from now on (rank {distributed.rank()}), the step was run again')
        logger.warning(message)
        return DecisionRecord('integration', 'packed_attention', reason, {
            'old': failed, 'new': self.kernel, 'rank': distributed.rank(), 'error': f'{type(error).__name__}: '
            f'{str(error)[:300]}'}, message, step=step)

    def follow(self, model: Any, records: list[DecisionRecord], step: int) -> DecisionRecord | None:
        """At a step boundary, every rank's records of the last step in hand: when another rank's kernel fell back and
        this one still runs it, fall back too (the ranks run one kernel again); the record says whose failure."""
        fell = [r for r in records if r.kind == 'packed_attention' and r.reason == 'fallback']
        if not fell or not self.switched:
            return None
        first = fell[0]
        return self.fall_back(model, RuntimeError(f'rank {first.values.get("rank")}: {first.values.get("error")}'),
                              step, reason='follow')

    def refinish(self, batch: Any) -> Any:
        """A prepared batch (or a slot of passes) finished for the current kernel again."""
        from ..data.slots import PassGroup
        from .padding_free import packed_rows_only
        if isinstance(batch, PassGroup):
            return PassGroup([self.refinish(b) for b in batch.passes])
        if isinstance(batch, PackedBatch):
            return finish_packed(packed_rows_only(batch), self.kernel)
        return batch

