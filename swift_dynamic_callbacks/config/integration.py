"""Settings of the trainer-side integration (YAML key ``dynamic_callbacks.integration``); no torch imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import Choice, Flag, Int, Reads, Settings, Text, TokensOrAuto, from_mapping, setting

#: the attention backends packed rows can be switched to, one a module under ``integrations/attention/`` (its registry
#: checks these names on import; they are here so that the settings import no torch)
ATTENTION_BACKENDS = ('flash', 'flex', 'sdpa')
#: ``packed_attention``'s values: ``auto``, a backend, or ``keep`` (the model's own)
PACKED_ATTENTION = ('auto', *ATTENTION_BACKENDS, 'keep')


@dataclass(frozen=True)
class IntegrationConfig(Settings):
    """Settings of the integration itself (YAML key ``dynamic_callbacks.integration``).

    Attributes:
        record_samples: write ``dynamic_samples.rank<R>.jsonl`` with the dataset indices of every micro-batch
            (an audit trail of exactly-once data; small: one line per optimizer step).
        log_values: merge the current batch size, pieces, global batch and samples seen into training logs.
        max_steps_unit: what ``max_steps`` counts when the batch size changes: ``steps`` (default: optimizer
            steps, whatever their size; HF's meaning) or ``samples`` (a data budget of ``max_steps`` steps at the
            configured ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` samples per device: growing
            the batch then means fewer, larger steps, and training stops at the first step boundary where the budget
            of samples is used; the LR schedule, ``state.max_steps`` and the progress bar follow the step count the
            budget needs at the current batch size).
        oom_recovery: ``auto`` (default), ``true`` or ``false``. On, an out-of-memory error inside a training step
            does not end the run: the step's passes are run again at half the pass size with the same samples and
            gradient (see :meth:`Integration.run_micro_batch`). ``auto`` turns it on where the engine allows it (one
            process, DDP) and off under FSDP2 and DeepSpeed, whose forward and backward passes hold collectives
            (the ``engine`` record at start says so); ``true`` there is refused (``config.engines``).
        oom_single_sample_retries: how often a one-sample pass that ran out of memory is run again, memory freed
            before each try (a one-off spike or fragmentation), before the sample is declared too large (default 2).
        oom_grow_back_steps: an OOM lowers what a pass may hold (its *tokens* under ``length_batching.pass_tokens``,
            else its rows) below the failing pass: to the largest pass that ran clean, else half the failing one;
            later steps are planned and cut at it. Every this many clean steps (no OOM on any rank) it grows back
            toward the smallest pass that failed: halfway while it is more than a quarter below it and no grown
            budget failed yet, else an eighth (at most halfway); halfway to the ceiling (``pass_tokens``, or the
            micro-batch) when none did; it settles once within 1/8 of the failure (a ``pass_budget`` record each
            change; ``dynamic/pass_budget`` or ``dynamic/pass_rows_budget`` in the logs). ``0``: never grows back.
            Default 1 (was 2: a run of ten steps spent most of itself below the memory end).
        oom_probe_steps: after this many clean steps at a budget settled below a failed pass, the budget probes one
            step (1/8) above the failure: a probe that runs clean forgets the failure (a one-off OOM does not cap the
            run for good) and growth resumes; a probe that fails settles again and the next probe waits four times
            longer, so a real memory end costs a bounded number of OOMs (three in 300 steps at the default).
            ``0``: never probes. Default 64. (Was ``oom_forget_steps``, which grew straight back to the ceiling.)
        enabled: ``false`` turns the whole pack off for a baseline run (as does the environment variable
            ``SWIFT_DYNAMIC_CALLBACKS_DISABLE=1``): no integration, no callback does anything, the run is the plain
            trainer's; one log line and one ``pack``/``disabled`` record say so.
        fail_fast: an unexpected exception inside a pack callback's hook ends the run (debugging) instead of
            disabling that callback with a ``fault`` record.
        allow_config_change: resuming with settings other than those the checkpoint was written with (a growth
            interval, a budget, an LR shape ...) is refused unless this is ``true``; then every changed setting is
            one ``config_change`` record with its old and new value. Logging settings (``record_samples``,
            ``log_values``, ``fail_fast``, ``training_log``) may always change.
        replay: path of a previous run's ``dynamic_decisions.jsonl`` (or its output directory): the integration
            applies the batch and LR requests recorded there (``applied_request`` records) at the same step
            boundaries and ignores the callbacks' own requests, so the run repeats the recorded one. That it exists
            is checked when the ``dynamic_callbacks:`` section is parsed (``config.pack.parse_section``).
        stream_window: with ``streaming: true`` and ``length_batching``, how many rows of the stream (per rank) are
            read ahead and laid out at once: sorted into length buckets and cut by the token budget or rules
            (default 1024; larger: less padding, more rows held in memory). Rows never leave their window, so the
            stream order is kept across windows. Read only on a stream.
        packed_attention: with ``length_batching.padding_free``, the attention the packed rows run with: ``auto``
            (default) switches a model on sdpa to the best kernel the machine has for packed rows (flash-attn's
            varlen where it is installed, else ``flex_attention`` on CUDA; on CPU sdpa stays; under FSDP2 /
            DeepSpeed the model's own is kept); ``flash`` / ``flex`` / ``sdpa`` ask for that kernel (refused at start
            when it is unavailable or fails its proof); ``keep`` leaves the model's. The choice is proven to keep rows
            apart before training (a kernel switched to: and to run forward and backward in train mode), agreed by
            all ranks and written as a ``packed_attention`` record; under ``auto`` a kernel that fails to load or a
            proof is undone (said in the record). A switched kernel that fails during training (not an OOM) falls
            back to the model's own attention with a record, and the step runs again.
        grpo_pass_tokens: under ``rlhf_type: grpo``, GRPO's loss over a micro-batch of completions runs as passes of
            at most this many padded tokens (prompt + completion) each, whole completions, each weighted by its
            share of the loss under ``loss_type`` (the one-pass gradient); on one process an OOM in a pass runs its
            halves instead and lowers the budget (the ``oom_*`` settings). ``auto``: the budget from the device's free
            memory at train start and the model's shape, as ``length_batching.pass_tokens: auto`` (the smallest over
            the ranks; a ``pass_tokens`` record with its figures). ``null`` (default): GRPO's own passes.
    """

    record_samples: bool = setting(Flag(), False)
    log_values: bool = setting(Flag(), True)
    max_steps_unit: str = setting(Choice(('steps', 'samples')), 'steps')
    oom_recovery: bool | str = setting(Choice(('auto', True, False)), 'auto')
    oom_single_sample_retries: int = setting(Int(0, 100), 2)
    oom_grow_back_steps: int = setting(Int(0, 100_000), 1)
    oom_probe_steps: int = setting(Int(0, 1_000_000), 64)
    enabled: bool = setting(Flag(), True)
    fail_fast: bool = setting(Flag(), False)
    replay: str | None = setting(Text('output/first_run/dynamic_decisions.jsonl', optional=True), None)
    allow_config_change: bool = setting(Flag(), False)
    stream_window: int = setting(Int(1, 10_000_000), 1024)
    packed_attention: str = setting(Choice(PACKED_ATTENTION), 'auto')
    grpo_pass_tokens: int | str | None = setting(TokensOrAuto(1, 1_000_000_000, optional=True), None)

    reads = (Reads('oom_recovery', {'auto': ('oom_single_sample_retries', 'oom_grow_back_steps', 'oom_probe_steps'),
                                    True: ('oom_single_sample_retries', 'oom_grow_back_steps', 'oom_probe_steps'),
                                    False: ()}), )

    renamed = {'oom_forget_steps': 'oom_probe_steps'}

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None) -> 'IntegrationConfig':
        return from_mapping(cls, mapping, prefix='dynamic_callbacks.integration')
