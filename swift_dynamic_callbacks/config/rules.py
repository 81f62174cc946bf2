"""The rules about the rest of a run that the pack checks twice, written once: before launch (from the YAML and the
flags after it, :func:`.launch.check_run`) and at train start (from the trainer: ``integrations/data.py``,
``integrations/steps.py``, ``callbacks/growth/noise_scale.py``). Each rule is a function of :class:`RunFacts` (or of
the few values it reads) that returns the refusal's message or ``None``; both checks call the same function with what
each knows, so the message is the same whichever check stops the run. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from . import ConfigError

SECTION = 'dynamic_callbacks'

#: why a sample of ``swift rlhf`` cannot run as several passes (the launch check and the step runner say it alike)
PAIRS_WHY = ('a micro-batch of pairs is its chosen rows then its rejected rows (KTO: completions and KL rows) and '
             'the loss is a mean over pairs, so it cannot be split into smaller forward/backward passes')


@dataclass(frozen=True)
class RunFacts:
    """What the run rules read, from the YAML before launch or from the trainer's arguments at train start.

    Attributes:
        sequence_parallel_size: ms-swift's ``sequence_parallel_size`` (1: none).
        dataloader_drop_last: HF's ``dataloader_drop_last``.
        auto_find_batch_size: HF's ``auto_find_batch_size``.
        streaming: the training data is a stream (no length).
        max_steps: HF's ``max_steps`` (``<= 0``: not set).
        max_steps_unit: the integration's ``max_steps_unit``.
        splitters: the pack settings that run a step as other forward/backward passes than the fixed layout's
            (:func:`pass_splitters`; empty: none).
        task_type: ms-swift's ``task_type`` (``None``: its default, ``causal_lm``).
        loss_type: ms-swift's ``loss_type`` (``None``: the model's own loss).
        compute_loss_func: the name of a loss function the trainer calls instead of the model's loss (HF's
            ``compute_loss_func``, set in Python) that is neither ms-swift's causal-LM loss nor marked a token sum
            (:func:`mark_token_sum_loss`); ``None``: none such.
        label_smoothing_factor: HF's ``label_smoothing_factor``.
        router_aux_loss_coef: ms-swift's ``router_aux_loss_coef`` (MoE).
        world_size: processes of the run.
        average_tokens_across_devices: HF's ``average_tokens_across_devices``.
        include_num_input_tokens_seen: HF's ``include_num_input_tokens_seen`` is on (any value but ``no``).
        tokens_counted_per_slot: the installed transformers counts input tokens in ``Trainer._track_num_input_tokens``
            (transformers >= 5), which the pack's trainer mixin overrides; older ones count inline.
        oom_recovery: the integration's ``oom_recovery`` (``auto``, ``True`` or ``False``).
        packed: ms-swift packs a micro-batch into one ``[1, N]`` row (``packing`` / ``padding_free``).
        moe: the model is a mixture of experts (``True`` where unknown: a balancing loss is then assumed to be one).
        layout: the layout of the model's micro-batches (:data:`.models.LAYOUTS`; ``None``: unknown).
        model_setting: how a message names the model (``model: <dir> (its config.json)``, ...).
    """

    sequence_parallel_size: float = 1
    dataloader_drop_last: bool = False
    auto_find_batch_size: bool = False
    streaming: bool = False
    max_steps: float = -1
    max_steps_unit: str = 'steps'
    splitters: tuple[str, ...] = ()
    task_type: str | None = None
    loss_type: str | None = None
    compute_loss_func: str | None = None
    label_smoothing_factor: float = 0.0
    router_aux_loss_coef: float = 0.0
    world_size: int = 1
    average_tokens_across_devices: bool = True
    include_num_input_tokens_seen: bool = False
    tokens_counted_per_slot: bool = True
    oom_recovery: bool | str = 'auto'
    packed: bool = False
    moe: bool = True
    layout: str | None = None
    model_setting: str = ''


#: why a pass cannot be run again on one rank under sequence parallelism
SP_WHY = ('under sequence parallelism every forward/backward pass runs its group\'s all-to-all (Ulysses) or ring '
          'exchange, so one rank cannot run a pass again alone')


def sequence_parallel(facts: RunFacts) -> str | None:
    """Sequence parallelism (``sequence_parallel_size: N``): the pack deals the data over the data-parallel ranks
    (a group of N shares its samples and cuts its passes alike). Refused: ``oom_recovery: true`` (an OOM ends the
    run, with the note a resumed run plans below) and a stream (not supported there)."""
    size = facts.sequence_parallel_size
    if size <= 1:
        return None
    if facts.oom_recovery is True:
        return (f'{SECTION}.integration.oom_recovery: true cannot be used with sequence_parallel_size: {size:g}: '
                f'{SP_WHY}; use auto (off: an OOM ends the run and the resumed run plans below it) or false')
    if facts.streaming:
        return (f'streaming: true is not supported with sequence_parallel_size: {size:g} by swift-dynamic-callbacks '
                '(a stream is read rank::world, not by data-parallel group); use a dataset with a length, or '
                'sequence_parallel_size: 1')
    return None


def drop_last(facts: RunFacts) -> str | None:
    if facts.dataloader_drop_last:
        return ('dataloader_drop_last: must be false with swift-dynamic-callbacks (every sample is used exactly once '
                'per epoch; the last step of an epoch takes what is left), got true')
    return None


def auto_batch_size(facts: RunFacts) -> str | None:
    if facts.auto_find_batch_size:
        return ('auto_find_batch_size: must be false with swift-dynamic-callbacks (it restarts training from step 0 on '
                'OOM; the pack changes the batch size in place: memory_backoff and the integration\'s oom_recovery), '
                'got true')
    return None


def stream_steps(facts: RunFacts) -> str | None:
    if facts.streaming and facts.max_steps <= 0:
        return ('max_steps: streaming: true needs max_steps > 0: a stream has no length, so num_train_epochs cannot be '
                f'turned into steps; got {facts.max_steps:g}')
    return None


def stream_unit(facts: RunFacts) -> str | None:
    if facts.streaming and facts.max_steps_unit != 'steps':
        return (f'{SECTION}.integration.max_steps_unit: {facts.max_steps_unit} is not supported with streaming: '
                'true: a sample budget is counted in epochs of a dataset whose length a stream does not have; use '
                'steps')
    return None


#: what a step's loss must be for any pass layout to give the fixed layout's gradient
TOKEN_SUM_WHY = ('other forward/backward passes than the fixed micro-batches give the same gradient only when a '
                 'pass\'s loss is the sum of its token losses over the step\'s label tokens (num_items_in_batch, '
                 'ms-swift\'s causal-LM loss); ')


def token_sum_loss(facts: RunFacts) -> str | None:
    """Passes cut by tokens (``pass_tokens``) or split (``split: passes``, pieces, ``memory_backoff``) keep the
    gradient only under a token-sum loss normalised over the step: refuse the settings that make it a per-pass mean
    (the step's gradient would then scale with the number of passes, i.e. with the rows' lengths)."""
    if not facts.splitters:
        return None
    what = facts.splitters[0]
    if facts.task_type not in (None, 'causal_lm'):
        return (f'task_type: {facts.task_type} cannot be combined with {what}: {TOKEN_SUM_WHY}{facts.task_type} '
                'averages each micro-batch; allowed: causal_lm (or remove the setting)')
    if facts.loss_type not in (None, 'cross_entropy'):
        return (f'loss_type: {facts.loss_type} cannot be combined with {what}: {TOKEN_SUM_WHY}allowed: the model\'s '
                'own loss or cross_entropy (or remove the setting)')
    if facts.compute_loss_func is not None:
        return (f'compute_loss_func: {facts.compute_loss_func} cannot be combined with {what}: {TOKEN_SUM_WHY}the '
                'pack cannot tell whether a Python loss function is one; allowed: no compute_loss_func (the '
                'model\'s loss), loss_type cross_entropy, or a function that returns sum(token losses) / '
                'num_items_in_batch, declared with swift_dynamic_callbacks.mark_token_sum_loss(fn)')
    if facts.label_smoothing_factor > 0:
        return (f'label_smoothing_factor: {facts.label_smoothing_factor:g} cannot be combined with {what}: '
                f'{TOKEN_SUM_WHY}HF\'s label smoother returns each pass\'s mean; allowed: 0 (or remove the setting)')
    if facts.router_aux_loss_coef > 0 and facts.moe:
        return (f'router_aux_loss_coef: {facts.router_aux_loss_coef:g} cannot be combined with {what}: a MoE load-'
                'balancing loss depends on which tokens share a pass, so another pass layout changes its gradient; '
                'allowed: 0 (or remove the setting)')
    if facts.world_size > 1 and not facts.average_tokens_across_devices:
        return (f'average_tokens_across_devices: false cannot be combined with {what} under {facts.world_size} '
                'processes: each rank would normalise by its own label tokens, so ranks whose passes hold fewer '
                'tokens weigh more (and a rank without samples scales the step down); allowed: true (HF\'s default)')
    return None


#: ms-swift task types whose loss compares the rows of a call (in-batch negatives, lists): no piece is independent
PAIRWISE_TASKS = ('embedding', 'reranker', 'generative_reranker')


def loss_kind_of(*, task_type: str | None, loss_type: str | None, compute_loss_func: str | None,
                 label_smoothing_factor: float, router_aux_loss_coef: float, moe: bool = True,
                 accepts_loss_kwargs: bool = True) -> tuple[str, str | None, str]:
    """``(kind, setting, why)`` of a run's training loss from its settings: ``token_sum`` (pieces of a micro-batch
    add up as they are), ``token_mean`` / ``row_mean`` (a mean over a call's label tokens / rows: pieces add up
    weighted by their share) or ``unknown`` (pieces do not add up); ``setting`` names what decided it."""
    if loss_type not in (None, 'cross_entropy'):
        return ('unknown', f'loss_type: {loss_type}', f'loss_type {loss_type} is not a sum of independent per-token '
                'or per-row terms the pack knows')
    if compute_loss_func is not None:
        return ('unknown', f'compute_loss_func: {compute_loss_func}', f'the Python loss {compute_loss_func} may '
                'compare the rows of a call; declare a token sum with swift_dynamic_callbacks.mark_token_sum_loss')
    if task_type in PAIRWISE_TASKS:
        return ('unknown', f'task_type: {task_type}', f'a {task_type} loss compares the rows of a call (in-batch '
                'negatives, lists), so a piece\'s loss is not part of the whole')
    if router_aux_loss_coef > 0 and moe:
        return ('unknown', f'router_aux_loss_coef: {router_aux_loss_coef:g}', 'a MoE load-balancing loss depends on '
                'which tokens share a pass')
    if task_type == 'seq_cls':
        return 'row_mean', 'task_type: seq_cls', 'a sequence classifier\'s loss averages the rows of a call'
    if label_smoothing_factor > 0:
        return ('token_mean', f'label_smoothing_factor: {label_smoothing_factor:g}', 'HF\'s label smoother averages '
                'the label tokens of a call')
    if not accepts_loss_kwargs:
        return ('unknown', 'the model\'s forward', 'the model computes its own loss without num_items_in_batch (a mean '
                'the pack does not see)')
    return 'token_sum', None, 'token losses summed over the step\'s label tokens (num_items_in_batch)'


def recovery_refused(setting: str, why: str) -> str:
    """The refusal of ``oom_recovery: true`` under a loss whose pieces do not add up (the launch check and the step
    runner say it alike)."""
    return (f'{SECTION}.integration.oom_recovery: true cannot be combined with {setting}: recovery runs the failing '
            f'micro-batch again in smaller passes, and {why}, so the pieces would not give its gradient; allowed: auto '
            '(recovery off for this run, said in the engine record) or false')


def recovery_loss(facts: RunFacts) -> str | None:
    """``oom_recovery: true`` needs a loss whose pieces add up (a token sum, or a mean the pack weights)."""
    if facts.oom_recovery is not True:
        return None
    kind, setting, why = loss_kind_of(task_type=facts.task_type, loss_type=facts.loss_type,
                                      compute_loss_func=facts.compute_loss_func,
                                      label_smoothing_factor=facts.label_smoothing_factor,
                                      router_aux_loss_coef=facts.router_aux_loss_coef, moe=facts.moe)
    return recovery_refused(setting, why) if kind == 'unknown' else None


#: why OOM recovery is off where ms-swift packs a micro-batch into one row
PACKED_WHY = ('ms-swift\'s packing / padding_free collate a micro-batch into one [1, N] row of many samples, which '
              'recovery cannot cut into smaller passes')


def recovery_packed(facts: RunFacts) -> str | None:
    """``oom_recovery: true`` needs micro-batches it can cut: not ms-swift's packed rows (:data:`PACKED_WHY`)."""
    if facts.oom_recovery is True and facts.packed:
        return (f'{SECTION}.integration.oom_recovery: true cannot be combined with packing / padding_free: '
                f'{PACKED_WHY}; allowed: auto (recovery off for this run, said in the engine record) or false')
    return None


def uncut_layout(facts: RunFacts) -> str | None:
    """A multimodal model of a layout no input kind cuts (:func:`.models.unsupported_why`): its micro-batches are never
    cut, so a setting that cuts them, and ``oom_recovery: true``, are refused (with ``auto`` recovery is off, said in
    the ``engine`` record)."""
    if facts.layout != 'multimodal':
        return None
    from .models import unsupported_why
    why = unsupported_why(facts.model_setting)
    if facts.splitters:
        return f'{facts.splitters[0]} cannot be used here: {why}; remove it'
    if facts.oom_recovery is True:
        return (f'{SECTION}.integration.oom_recovery: true cannot be used here: {why}; allowed: auto (recovery off '
                'for this run, said in the engine record) or false')
    return None


def token_counter(facts: RunFacts) -> str | None:
    """HF's input-token counter gathers across ranks once per micro-batch slot; transformers before 5 counts inline
    and skips a slot without ``input_ids`` (the pack's empty and several-pass slots) on that rank only."""
    if facts.include_num_input_tokens_seen and facts.world_size > 1 and not facts.tokens_counted_per_slot:
        return (f'include_num_input_tokens_seen: on under {facts.world_size} processes needs transformers >= 5 with '
                'swift-dynamic-callbacks: this transformers counts input tokens inline, one collective per '
                'micro-batch, and skips the pack\'s empty and several-pass micro-batch slots on the rank that has '
                'them, so the ranks\' collectives would not match (a hang); allowed: false (the pack counts tokens '
                'itself: dynamic/tokens_seen), one process, or transformers >= 5')
    return None


#: the attribute :func:`mark_token_sum_loss` sets on a loss function
TOKEN_SUM_MARK = '__swift_dynamic_token_sum__'


def mark_token_sum_loss(loss_func: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that ``loss_func`` (a trainer's ``compute_loss_func``) returns the sum of its token losses divided by
    ``num_items_in_batch``, so that pass splits (``pass_tokens``, ``split: passes``, ``memory_backoff``) may run with
    it; returns ``loss_func`` (usable as a decorator). The pack takes the declaration on trust."""
    setattr(loss_func, TOKEN_SUM_MARK, True)
    return loss_func


def custom_loss_name(loss_func: Any) -> str | None:
    """The :attr:`RunFacts.compute_loss_func` of a trainer whose ``compute_loss_func`` is ``loss_func``: ``None`` when
    there is none, when it is ms-swift's causal-LM loss (``loss_type: cross_entropy``) or when it is marked with
    :func:`mark_token_sum_loss`; else its name."""
    if loss_func is None or getattr(loss_func, TOKEN_SUM_MARK, False):
        return None
    kind = type(loss_func)
    if kind.__name__ == 'CustomCrossEntropyLoss' and kind.__module__.startswith('swift.'):
        return None
    return getattr(loss_func, '__qualname__', None) or kind.__qualname__


#: the rules both checks run on :class:`RunFacts`, in order
RUN_RULES: tuple[Callable[[RunFacts], str | None], ...] = (sequence_parallel, drop_last, auto_batch_size,
                                                           stream_steps, stream_unit, token_sum_loss,
                                                           token_counter, recovery_loss, recovery_packed,
                                                           uncut_layout)


def pass_splitters(configs: Mapping[str, Any]) -> list[str]:
    """The settings (of the pack callbacks listed, ``name -> config``) that run a micro-batch as several
    forward/backward passes or cut a step into other passes than the fixed micro-batches."""
    out = []
    growth = configs.get('batch_growth')
    if growth is not None and growth.micro_batch_cap is not None:
        out.append(f'{SECTION}.batch_growth.micro_batch_cap')
    schedule = configs.get('batch_schedule')
    if schedule is not None and schedule.splits_micro_batches:
        out.append(f'{SECTION}.batch_schedule.pieces')
    length = configs.get('length_batching')
    if length is not None and length.splits_passes:
        out.append(f'{SECTION}.length_batching.split: passes')
    if length is not None and length.pass_tokens is not None:
        out.append(f'{SECTION}.length_batching.pass_tokens')
    if 'memory_backoff' in configs:
        out.append('callbacks: memory_backoff (it caps the samples of a pass)')
    return out


def check_facts(facts: RunFacts, rules: tuple[Callable[[RunFacts], str | None], ...] = RUN_RULES) -> None:
    """Raise a :class:`ConfigError` with the first rule's message that refuses ``facts``."""
    for rule in rules:
        message = rule(facts)
        if message is not None:
            raise ConfigError(message)


def noise_scale_passes(setting: str, gradient_accumulation_steps: float, micro_batch_cap: int | None = None,
                       maximum: int = 1, *, pass_tokens: bool = False) -> str | None:
    """The gradient-noise probe (``batch_growth`` ``policy: noise_scale``, ``training_log`` ``noise_scale``) compares
    a step's first pass with the whole step: it needs two passes a step. ``setting``: the setting asking for it, as
    the message names it."""
    if pass_tokens:
        return (f'{SECTION}.length_batching.pass_tokens cannot be combined with {setting}: the noise scale compares a '
                'step\'s first forward/backward pass with the whole step, and pass_tokens runs a step in as few passes '
                'as fit its budget (often one); allowed: remove pass_tokens (or the noise-scale setting)')
    if gradient_accumulation_steps < 2 and not (micro_batch_cap is not None and micro_batch_cap < maximum):
        cap = '' if micro_batch_cap is None and maximum <= 1 else f' and micro_batch_cap is {micro_batch_cap}'
        remedy = '' if not cap else ' (or a micro_batch_cap below maximum)'
        return (f'{setting} needs at least two forward/backward passes per optimizer step to compare gradients, but '
                f'gradient_accumulation_steps is {gradient_accumulation_steps:g}{cap}; set '
                f'gradient_accumulation_steps >= 2{remedy}')
    return None


#: ``rlhf_type`` values whose trainer the pack drives whole (a sample is a pair, or a completion and its KL row)
RLHF_PAIRS = ('dpo', 'orpo', 'simpo', 'cpo', 'rm', 'kto')
#: ``rlhf_type`` values whose trainer generates rollouts and draws its prompts with its own sampler: the pack's
#: run-level callbacks only (they decide the run through the LR schedule, the stop flag and the checkpoints, never
#: the batch or the passes)
RLHF_RUN_LEVEL = ('grpo', 'gkd')
#: the pack callbacks that run under :data:`RLHF_RUN_LEVEL`
RUN_LEVEL_CALLBACKS = ('lr_schedule', 'early_stopping', 'checkpoint_rotation', 'training_log')
#: why the others do not, by ``rlhf_type``
ROLLOUT_WHY = {
    'grpo': ('its trainer draws each step\'s prompts with its own repeat sampler (every prompt num_generations '
             'times, advantages computed over a group) and runs its own loss passes over the completions, so the '
             'pack does not build its batches (it cuts the loss passes by tokens with '
             'dynamic_callbacks.integration.grpo_pass_tokens)'),
    'gkd': ('its trainer samples its own prompts and generates on-policy completions inside each step (scored '
            'against the teacher\'s logits), so the pack does not build its batches or cut its passes'),
}
#: why nothing of the pack runs under PPO
PPO_WHY = 'ms-swift\'s PPO trainer runs TRL\'s own training loop, which has no step boundary the pack can act at'


def rlhf_refusal(rlhf_type: str | None, listed: Sequence[str], configs: Mapping[str, Any],
                 oom_recovery: bool | str = 'auto', *, grpo_pass_tokens: int | None = None,
                 get: Callable[[str], Any] | None = None, world_size: int = 1) -> str | None:
    """What the pack refuses under ``swift rlhf --rlhf_type <rlhf_type>`` (``listed``: the pack callbacks listed,
    ``configs``: their settings; none listed: the integration alone, which runs whenever the pack is on), or ``None``:
    checked before the model loads on every route (``swift-dynamic check`` and ``rlhf``, the plugin and Python routes:
    ``integrations/swift.py``) and again when the trainer is built. Then what ``integration.grpo_pass_tokens`` cannot
    run with (:func:`grpo_passes_refusal`; ``get`` reads the ms-swift settings as the route holds them, ``rlhf_type``
    alone without it; ``world_size``: the run's processes)."""
    return (_rlhf_type_refusal(rlhf_type, listed, configs, oom_recovery, grpo_pass_tokens)
            or grpo_passes_refusal(grpo_pass_tokens, get or {'rlhf_type': rlhf_type}.get,
                                   oom_recovery=oom_recovery, world_size=world_size))


def _rlhf_type_refusal(rlhf_type: str | None, listed: Sequence[str], configs: Mapping[str, Any],
                       oom_recovery: bool | str, grpo_pass_tokens: int | None) -> str | None:
    """:func:`rlhf_refusal` by ``rlhf_type``: what its trainer allows of the listed callbacks (none listed: of the
    integration alone)."""
    if rlhf_type is None:
        return None
    rlhf = str(rlhf_type).strip().lower()
    uses = ', '.join(listed) if listed else 'none listed: the integration alone'
    if rlhf == 'ppo':
        return (f'rlhf_type: ppo is not supported by swift-dynamic-callbacks (callbacks: {uses}): {PPO_WHY}; run it '
                'with swift rlhf, without the pack')
    if rlhf in RLHF_RUN_LEVEL:
        why = ROLLOUT_WHY[rlhf]
        batch = [n for n in listed if n not in RUN_LEVEL_CALLBACKS]
        if batch:
            return (f'rlhf_type: {rlhf} cannot be combined with callbacks: {batch[0]}: {why}; allowed under '
                    f'{rlhf}: {", ".join(RUN_LEVEL_CALLBACKS)}')
        log = configs.get('training_log')
        if log is not None and getattr(log, 'noise_scale', False):
            return (f'{SECTION}.training_log.noise_scale: true cannot be used with rlhf_type: {rlhf}: {why} '
                    '(the probe reads its passes); set it false')
        if oom_recovery is True and not (rlhf == 'grpo' and grpo_pass_tokens is not None):
            return (f'{SECTION}.integration.oom_recovery: true cannot be used with rlhf_type: {rlhf}: {why}; '
                    'use auto or false' + ('; under grpo it recovers in the loss passes cut by '
                                           f'{SECTION}.integration.grpo_pass_tokens' if rlhf == 'grpo' else ''))
        return None
    if rlhf not in RLHF_PAIRS:
        return (f'rlhf_type: {rlhf} is not supported by swift-dynamic-callbacks (callbacks: {uses}); allowed: '
                f'{", ".join(RLHF_PAIRS + RLHF_RUN_LEVEL)}')
    splitters = pass_splitters(configs)
    if splitters:
        return (f'rlhf_type: {rlhf} cannot be combined with {splitters[0]}: {PAIRS_WHY}; remove it (batch growth, '
                'schedules, length_batching and early stopping work)')
    if oom_recovery is True:
        return (f'{SECTION}.integration.oom_recovery: true is not supported with rlhf_type: {rlhf}: {PAIRS_WHY}; use '
                'auto (off under swift rlhf) or false')
    return None


#: GRPO settings under which a loss pass over some of a micro-batch's completions would not be its share of the
#: one-pass loss (or whose loss is not computed where the passes cut), with why: refused with ``grpo_pass_tokens``
GRPO_PASSES_REFUSED = {
    'use_liger_kernel': 'the liger loss runs its own fused kernel over the whole micro-batch',
    'top_entropy_quantile': ('the entropy threshold is a quantile over all of a call\'s tokens: each pass would '
                             'take its own'),
    'chord_sft_dataset': 'CHORD draws another SFT batch at every loss call: passes would draw several',
    'sdar_loss_coef': 'SDAR\'s auxiliary loss is a token mean over a call, not weighted as the passes are',
    'rollout_importance_sampling_mode': 'not checked with passes (its weights are not proven per completion)',
    'padding_free': 'a packed micro-batch is one [1, N] row and cannot be cut by completions',
    'multimodal': 'not proven with passes (ms-swift re-encodes a multimodal slice from its samples)',
    'deepspeed': ('every backward under DeepSpeed is an engine step of its own; the passes run on one process or '
                  'under DDP'),
    'fsdp': 'the passes run on one process or under DDP (FSDP2 reduces in every backward)',
    'sequence_parallel_size': 'every pass would hold the group\'s all-to-all',
}


#: why GRPO's loss passes recover from an OOM on one process only
GRPO_RECOVERY_WHY = ('every GRPO loss pass holds ms-swift\'s metric gathers, so one rank cannot re-cut a pass alone '
                     '(an OOM there ends the run, naming what to lower)')


def grpo_passes_refusal(pass_tokens: int | None, get: Callable[[str], Any], *, oom_recovery: bool | str = 'auto',
                        world_size: int = 1) -> str | None:
    """What ``integration.grpo_pass_tokens`` cannot run with (``get(name)``: an ms-swift setting as the YAML, the
    parsed arguments or the trainer hold it; ``None`` where unknown), or ``None``; asked before the model loads and
    again when training starts. ``oom_recovery: true`` is refused under several processes (``world_size``):
    :data:`GRPO_RECOVERY_WHY`."""
    if pass_tokens is None:
        return None
    name = f'{SECTION}.integration.grpo_pass_tokens: {pass_tokens}'
    rlhf = get('rlhf_type')
    if str(rlhf or '').lower() != 'grpo':
        return f'{name} cuts GRPO\'s loss passes: it needs rlhf_type: grpo (got {rlhf!r}); remove it'
    if oom_recovery is True and world_size > 1:
        return (f'{SECTION}.integration.oom_recovery: true cannot be used with rlhf_type: grpo under {world_size} '
                f'processes: {GRPO_RECOVERY_WHY}; use auto (off there) or false')
    from ..policies.rl_passes import WEIGHTING
    loss_type = get('loss_type')
    if isinstance(loss_type, (list, tuple)) and len(loss_type) == 1:
        loss_type = loss_type[0]
    if loss_type is not None and loss_type not in WEIGHTING:
        return (f'{name} cannot be used with loss_type: {loss_type!r}: its loss is not a sum of per-completion '
                f'parts the passes can weight; allowed: {", ".join(WEIGHTING)}')
    off = {'use_liger_kernel': bool(get('use_liger_kernel')),
           'top_entropy_quantile': get('top_entropy_quantile') not in (None, 1, 1.0),
           'chord_sft_dataset': bool(get('chord_sft_dataset')),
           'sdar_loss_coef': bool(get('sdar_loss_coef')),
           'rollout_importance_sampling_mode': get('rollout_importance_sampling_mode') is not None,
           'padding_free': bool(get('padding_free')) or bool(get('packing')),
           'multimodal': bool(get('multimodal')),
           'deepspeed': bool(get('deepspeed')),
           'fsdp': bool(get('fsdp')),
           'sequence_parallel_size': int(get('sequence_parallel_size') or 1) > 1}
    for setting, refused in off.items():
        if refused:
            shown = 'a multimodal model' if setting == 'multimodal' else f'{setting}: {get(setting)!r}'
            return f'{name} cannot be used with {shown}: {GRPO_PASSES_REFUSED[setting]}; remove one of them'
    if loss_type == 'bnpo' and get('off_policy_sequence_mask_delta') is not None:
        return (f'{name} cannot be used with loss_type: bnpo and off_policy_sequence_mask_delta: the mask changes the '
                'completion tokens bnpo divides by after the passes were weighted; remove one of them')
    return None
