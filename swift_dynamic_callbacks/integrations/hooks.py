"""Where HF ``Trainer`` / ms-swift call the pack: the trainer mixin, the internal callback, :func:`install`, and the
stand-in when the pack is off.

:func:`install` mixes :class:`DynamicTrainerMixin` into the trainer's class (works for ms-swift's
``Seq2SeqTrainer`` and for a plain ``transformers.Trainer``) and adds :class:`IntegrationCallback`. From then on:

- ``get_train_dataloader`` wraps the host's loader settings (collate function, workers, seed order) into an
  :class:`~swift_dynamic_callbacks.data.elastic.ElasticDataLoader` that has no fixed length, so HF runs its
  ``max_steps`` loop (for ``num_train_epochs`` runs, ``max_steps`` is derived from the initial batch size and the
  epoch budget is enforced by the integration);
- ``get_batch_samples`` (called by HF once per optimizer step, in every supported transformers version) is
  the step boundary: it applies and clears the control-flag requests (``protocol``), agreed across ranks,
  then draws the step's micro-batches from the elastic loader instead of HF's epoch iterator;
- ``training_step`` runs a micro-batch as one or more forward/backward passes (same ``num_items_in_batch``, so the
  same gradient) and lets a rank without samples join the others' collectives; ``compute_loss`` weighs a piece's
  loss by its share where the loss is a mean per call (:mod:`.loss_kind`);
- ``IntegrationCallback.on_step_end`` ends the HF epoch when the data epoch is used up
  (``control.should_epoch_stop``), keeps ``state.epoch`` honest and stops at the epoch budget;
- ``_save_checkpoint`` writes the pack state into the checkpoint first; ``train(resume_from_checkpoint=...)``
  restores it, so a resumed run continues at the next unseen sample;
- ``create_scheduler`` builds HF's scheduler for the honest schedule length and wraps it (LR scale and schedule);
- ``log`` merges the pack's numbers into every training log line and logs the LR the optimizer used in the step
  (ms-swift reads it after the scheduler stepped, i.e. the next step's).

``_inner_training_loop`` is not overridden. What each hook does is :class:`~.trainer.Integration`'s.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import torch
from transformers import TrainerCallback

from .. import protocol
from ..config import ConfigError
from ..config.integration import IntegrationConfig
from ..data.elastic import ElasticDataLoader
from ..records import DECISIONS_FILE, DecisionLog, DecisionRecord
from ..data.slots import EmptyMicroBatch, PassGroup, slot_batches
from ..data.stream import StreamLoader
from .loss_kind import weigh
from .trainer import Integration, logger

DISABLE_ENV = 'SWIFT_DYNAMIC_CALLBACKS_DISABLE'


class IntegrationCallback(TrainerCallback):
    """Internal callback of the integration.

    Placed first among the trainer's callbacks, so progress bars and HF's stop rule see its ``max_steps``.
    Hooks: ``on_train_begin`` (marks ``control`` as honoured, sets ``state.max_steps`` for epoch budgets),
    ``on_step_end`` (epoch end, honest ``state.epoch``, epoch budget), ``on_evaluate`` (the eval's OOM records, every
    rank's), ``on_train_end`` (takes the decision queue;
    the progress bar's total becomes the steps run).
    Flags set: ``should_epoch_stop``, ``should_training_stop``. State: none (the integration owns it).
    """

    def __init__(self, integration: Integration) -> None:
        self.integration = integration

    def on_train_begin(self, args, state, control, **kwargs):
        control._sdc_integration = True
        setattr(control, protocol.FAIL_FAST, self.integration.config.fail_fast)
        self.integration.refresh_budget('start')

    def on_step_end(self, args, state, control, **kwargs):
        self.integration.after_step(state, control)

    def on_evaluate(self, args, state, control, **kwargs):
        self.integration.eval_passes.end_eval()

    def on_train_end(self, args, state, control, **kwargs):
        self.integration.decisions.drain(control)
        self.integration.budget.sync_progress_bars(state.global_step)  # before the progress callback closes its bar


class RunHooks:
    """The overrides of every pack run: begin and end, the scheduler, the log line, the checkpoint (module docstring).
    :class:`RunLevelTrainerMixin` adds the step boundary alone; :class:`DynamicTrainerMixin` the batches and passes."""

    dynamic_integration: Integration

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        _add_integration_callback(self, self.dynamic_integration)
        self.dynamic_integration.begin_train(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.dynamic_integration.end_train()

    # ms-swift + transformers 4.57 build the scheduler through create_optimizer_and_scheduler, which calls HF's
    # create_scheduler on the class (not this override); 5.x calls create_scheduler. Both paths get the epoch
    # budget's schedule length and the scalable wrapper.
    def create_optimizer_and_scheduler(self, num_training_steps, *args, **kwargs):
        steps = self.dynamic_integration.schedule_length(num_training_steps)
        result = super().create_optimizer_and_scheduler(steps, *args, **kwargs)
        self.dynamic_integration.lr.wrap(self.lr_scheduler)
        return result

    def create_scheduler(self, num_training_steps, *args, **kwargs):
        steps = self.dynamic_integration.schedule_length(num_training_steps)
        return self.dynamic_integration.lr.wrap(super().create_scheduler(steps, *args, **kwargs))

    def log(self, logs, *args, **kwargs):
        self.dynamic_integration.update_logs(logs, self.control)
        return super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        output_dir = os.path.join(self._get_output_dir(trial=trial),
                                  f'{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}')
        self.dynamic_integration.save(output_dir)
        return super()._save_checkpoint(model, trial, *args, **kwargs)


class RunLevelTrainerMixin(RunHooks):
    """A trainer whose batches and passes are its own (``swift rlhf`` GRPO / GKD: a repeat sampler, rollouts): the
    pack acts at the step boundary only (its requests applied and agreed: the LR schedule; stop and checkpoint
    decisions are HF's own flags), then the trainer draws its step as it would."""

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        self.dynamic_integration.boundary(self.control)
        return super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """GRPO's loss in training as passes by tokens where ``grpo_pass_tokens`` asks for it (:mod:`.grpo_passes`),
        else the trainer's own."""
        passes = self.dynamic_integration.grpo_passes
        if passes is None or return_outputs or not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        return passes.compute_loss(self, model, inputs, num_items_in_batch)

    def _get_per_token_logps_and_entropies(self, model, model_inputs, grpo_batch, compute_entropy=False,
                                           origin_data=None):
        """GRPO's log-prob forwards without a gradient in training (a rollout's old and reference log-probs) as passes
        by tokens where ``grpo_pass_tokens`` asks for it (:meth:`.grpo_passes.GrpoPasses.logps`), else the trainer's
        own (the loss's forward, with a gradient, is already a pass)."""
        passes = self.dynamic_integration.grpo_passes
        whole = lambda: super(RunLevelTrainerMixin, self)._get_per_token_logps_and_entropies(  # noqa: E731
            model, model_inputs, grpo_batch, compute_entropy=compute_entropy, origin_data=origin_data)
        if passes is None or torch.is_grad_enabled() or not self.model.training:
            return whole()
        return passes.logps(self, model, model_inputs, grpo_batch, compute_entropy=compute_entropy, origin=origin_data,
                            whole=whole)


class DynamicTrainerMixin(RunHooks):
    """Overrides mixed into the trainer's own class by :func:`install` (see the module docstring)."""

    def get_train_dataloader(self, *args, **kwargs):
        # ms-swift passes ``skip_batches`` on resume; the elastic loader resumes from its own state instead.
        kwargs.pop('skip_batches', None)
        host_loader = super().get_train_dataloader()
        return self.dynamic_integration.build_loader(host_loader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        original = super().get_batch_samples
        return self.dynamic_integration.next_step(num_batches, device, original)

    def training_step(self, model, inputs, *args, **kwargs):
        num_items = args[0] if args else kwargs.get('num_items_in_batch')
        run = lambda part: super(DynamicTrainerMixin, self).training_step(model, part, *args, **kwargs)  # noqa: E731
        return self.dynamic_integration.run_micro_batch(model, inputs, run, num_items)

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        return weigh(result, self.dynamic_integration.runner.loss_weight)

    def prediction_step(self, model, inputs, *args, **kwargs):
        predict = lambda part: super(DynamicTrainerMixin, self).prediction_step(model, part, *args, **kwargs)  # noqa: E731
        return self.dynamic_integration.predict(model, inputs, predict)

    # transformers counts a batch's label tokens (summed over the ranks) for its loss, in training and in eval; the
    # pieces of an eval batch get the whole batch's count, counted once (``EvalPasses.num_items``)
    def _get_num_items_in_batch(self, batch_samples, device):
        count = lambda batches: super(DynamicTrainerMixin, self)._get_num_items_in_batch(batches, device)  # noqa: E731
        return self.dynamic_integration.eval_passes.num_items(batch_samples, count)

    # HF counts FLOPs and input tokens per micro-batch slot from its ``input_ids``; a slot of several passes
    # (``PassGroup``) or none (``EmptyMicroBatch``) holds none: count the passes it ran, one by one.
    def floating_point_ops(self, inputs):
        if isinstance(inputs, (PassGroup, EmptyMicroBatch)):
            return sum(super(DynamicTrainerMixin, self).floating_point_ops(part) for part in slot_batches(inputs))
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs):  # transformers >= 5 (4.57 counts inline; see config.rules)
        if not isinstance(inputs, (PassGroup, EmptyMicroBatch)):
            return super()._track_num_input_tokens(inputs)
        if self.args.include_num_input_tokens_seen in ('no', False):
            return None
        # one gather a slot on every rank, as HF makes for a micro-batch: ranks' slots may differ in kind
        tokens = sum((_hf_input_tokens(self, part) for part in slot_batches(inputs)), 0)
        tokens = torch.as_tensor(tokens, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()
        return None



_MIXED_CLASSES: dict[tuple[type, type], type] = {}


def _hf_input_tokens(trainer: Any, batch: Mapping[str, Any]) -> Any:
    """The input tokens HF's ``_track_num_input_tokens`` counts for one collated micro-batch (a tensor or an int,
    not gathered): ``non_padding``: the attention mask's ones, else the tokens that are not the pad token; else
    every position."""
    main = getattr(trainer.model, 'main_input_name', 'input_ids')
    if main not in batch:
        return 0
    if trainer.args.include_num_input_tokens_seen == 'non_padding':
        if 'attention_mask' in batch:
            return batch['attention_mask'].sum()
        pad = getattr(getattr(trainer, 'processing_class', None), 'pad_token_id', None)
        if pad is not None:
            return (batch[main] != pad).sum()
    return batch[main].numel()


def _add_integration_callback(trainer: Any, integration: Integration) -> None:
    callbacks = trainer.callback_handler.callbacks
    if not any(isinstance(cb, IntegrationCallback) for cb in callbacks):
        callbacks.insert(0, IntegrationCallback(integration))


def _skip_first_batches_patch() -> None:
    """Make ``transformers.trainer.skip_first_batches`` leave the elastic loader alone on resume.

    HF (and ms-swift's wrapper around it, which delegates loaders it does not know) would otherwise rebuild
    the loader and skip by batch count; the elastic loader resumes from its saved sample position instead.
    """
    import transformers.trainer as hf_trainer
    original = hf_trainer.skip_first_batches
    if getattr(original, '_sdc_patched', False):
        return

    def skip_first_batches(dataloader, num_batches=0):
        if isinstance(dataloader, (ElasticDataLoader, StreamLoader)):
            return dataloader
        return original(dataloader, num_batches)

    skip_first_batches._sdc_patched = True
    hf_trainer.skip_first_batches = skip_first_batches


def pack_disabled(config: IntegrationConfig | None) -> str | None:
    """Why the whole pack is off (``None`` when it is on): the environment variable or ``enabled: false``."""
    if os.environ.get(DISABLE_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on'):
        return f'{DISABLE_ENV}={os.environ[DISABLE_ENV]}'
    if config is not None and not config.enabled:
        return 'dynamic_callbacks.integration.enabled: false'
    return None


class PackOffCallback(TrainerCallback):
    """Stands in for the pack when it is switched off (:func:`pack_disabled`): at train begin it sets
    ``control.dynamic_disabled`` (pack callbacks' hooks then do nothing), logs one line and writes one
    ``pack``/``disabled`` record to the decision log (rank 0). Nothing else: the run is the plain trainer's."""

    def __init__(self, why: str, callbacks: Iterable[str] = ()) -> None:
        self.why = why
        self.callbacks = list(callbacks)

    def on_train_begin(self, args, state, control, **kwargs):
        setattr(control, protocol.DISABLED, True)
        control._sdc_integration = True  # no "request not honoured" warning: nothing is requested on purpose
        listed = f' ({", ".join(self.callbacks)} listed but inactive)' if self.callbacks else ''
        message = (f'swift-dynamic-callbacks is OFF ({self.why}): no dynamic behaviour{listed}; this is a plain '
                   'baseline run')
        logger.warning(message)
        log = DecisionLog(os.path.join(args.output_dir, DECISIONS_FILE),
                          enabled=bool(getattr(state, 'is_world_process_zero', True)))
        log.write(DecisionRecord('integration', 'pack', 'disabled', {'switch': self.why, 'callbacks': self.callbacks},
                                 message).stamped(step=state.global_step, epoch=float(state.epoch or 0.0),
                                                  samples_seen=0))


#: the trainer classes of ``swift rlhf`` that draw their own batches (:data:`..config.rules.RLHF_RUN_LEVEL`)
RUN_LEVEL_TRAINERS = {'GRPOTrainer': 'grpo', 'GKDTrainer': 'gkd'}


def run_level_reason(trainer: Any) -> str | None:
    """The ``rlhf_type`` whose trainer draws its own batches and passes (the pack acts at the step boundary only),
    from the trainer's class (its own or a base's name), else ``None``."""
    for base in type(trainer).__mro__:
        if base.__name__ in RUN_LEVEL_TRAINERS:
            return RUN_LEVEL_TRAINERS[base.__name__]
    return None


def install(trainer: Any, config: IntegrationConfig | None = None,
            pack_config: Mapping[str, Any] | None = None) -> Integration | None:
    """Install the integration on ``trainer`` (idempotent) and return it.

    Works on an ms-swift trainer under construction (the pack's callback factories call this) and on a fully
    built ``transformers.Trainer``: ``install(trainer); trainer.add_callback(cb); trainer.train()``.
    When the pack is switched off (:func:`pack_disabled`), the trainer is left as it is except for a
    :class:`PackOffCallback` (pack callbacks added to it do nothing), and ``None`` is returned.
    """
    why = pack_disabled(config)
    if why is not None:
        callbacks = getattr(getattr(trainer, 'callback_handler', None), 'callbacks', None)
        if callbacks is not None and not any(isinstance(cb, PackOffCallback) for cb in callbacks):
            callbacks.insert(0, PackOffCallback(why))
        return None
    existing = getattr(trainer, 'dynamic_integration', None)
    if isinstance(existing, Integration):
        if config is not None and config != existing.config:
            raise ConfigError(f'dynamic_callbacks.integration: installed twice with different settings '
                              f'({existing.config} vs {config})')
        existing.pack_config.update(pack_config or {})
        return existing
    cls = type(trainer)
    run_level = run_level_reason(trainer)
    mixin = RunLevelTrainerMixin if run_level else DynamicTrainerMixin
    if not issubclass(cls, RunHooks):
        mixed = _MIXED_CLASSES.get((cls, mixin))
        if mixed is None:
            mixed = type(f'Dynamic{cls.__name__}', (mixin, cls), {'__module__': cls.__module__})
            _MIXED_CLASSES[(cls, mixin)] = mixed
        trainer.__class__ = mixed
    integration = Integration(trainer, config, pack_config, run_level=run_level)
    trainer.dynamic_integration = integration
    _skip_first_batches_patch()
    if getattr(trainer, 'callback_handler', None) is not None:
        _add_integration_callback(trainer, integration)
        trainer.control._sdc_integration = True
    return integration
