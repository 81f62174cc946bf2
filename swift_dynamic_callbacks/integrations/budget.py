"""How many optimizer steps a run takes and when it stops: ``max_steps``, the epoch (or sample) budget, the progress
bars.

A ``num_train_epochs`` run has no fixed step count once the batch size can change. HF gets a loop bound no batch size
can outrun (the steps at batch size 1), the LR schedule the honest estimate at the initial batch size, and
``state.max_steps`` (progress, remaining time, HF's stop) the steps the rest of the budget needs at the current batch
size, refreshed at every change; training stops when the budget of data is used.
"""

from __future__ import annotations

from typing import Any

from ..config import ConfigError
from ..config.integration import IntegrationConfig
from ..policies.data_plan import before, steps_to_budget
from ..records import DecisionRecord
from .decisions import Decisions


class StepBudget:
    """The run's step count and data budget (see the module docstring).

    Args:
        trainer: the HF / ms-swift trainer (its ``args.max_steps`` is set while training runs and put back after).
        config: the integration settings (``max_steps_unit``).
        decisions: where its records are written.

    State: none (derived from the arguments and the loader again on resume).
    """

    def __init__(self, trainer: Any, config: IntegrationConfig, decisions: Decisions) -> None:
        self.trainer = trainer
        self.config = config
        self.decisions = decisions
        self.epoch_budget: float | None = None  # num_train_epochs (or a sample budget as epochs of data)
        self.reason = 'epoch_budget'
        self.scheduler_steps: int | None = None  # the LR schedule's length in budget runs
        #: the schedule's length a resumed checkpoint saved: the LR by step stays the saved run's, whatever layout
        self.saved_scheduler_steps: int | None = None
        self._user_max_steps: int | None = None

    def begin(self) -> None:
        self._user_max_steps = self.trainer.args.max_steps

    def end(self) -> None:
        """Give the user's ``max_steps`` back to the arguments."""
        if self._user_max_steps is not None:
            self.trainer.args.max_steps = self._user_max_steps

    def derive(self, loader: Any, batch_size: int) -> None:
        """For ``num_train_epochs`` runs (and ``max_steps_unit: samples``): set the loop bound and the budget.

        ``args.max_steps`` becomes the steps needed at batch size 1 (HF's loop and epoch ranges never run short,
        so no epoch ends early); the LR scheduler gets the honest estimate at the initial batch size
        (:attr:`scheduler_steps`); ``state.max_steps`` follows the budget (:meth:`refresh`).
        """
        args = self.trainer.args
        entries = loader.entries_per_step
        if args.max_steps > 0 and self.config.max_steps_unit == 'steps':
            self.epoch_budget = self.scheduler_steps = None
            return
        if args.max_steps > 0:  # a sample budget: max_steps steps at the initial batch size, as epochs of data
            budget_samples = args.max_steps * batch_size * entries
            epochs = budget_samples / max(loader.epoch_size, 1)
            reason = 'sample_budget'
            message = (f'max_steps {args.max_steps} at batch size {batch_size} is a budget of {budget_samples} '
                       'samples per device; training stops when they are used, whatever the batch sizes')
        else:
            epochs = float(args.num_train_epochs)
            if epochs <= 0:
                raise ConfigError(f'num_train_epochs: must be > 0 when max_steps is not set, got {epochs}')
            reason = 'epoch_budget'
            message = (f'{epochs} epochs at batch size {batch_size} are {{steps}} optimizer steps (the LR schedule\'s '
                       'length); training stops when the epochs of data are used, whatever the batch sizes')
        self.epoch_budget = epochs
        self.reason = reason
        self.scheduler_steps = steps_to_budget(0, 0, loader.epoch_size, epochs, batch_size, entries)
        if self.saved_scheduler_steps is not None:
            self.scheduler_steps = int(self.saved_scheduler_steps)
        values = {'num_train_epochs': epochs, 'max_steps': self.scheduler_steps}
        if reason == 'sample_budget':
            values = {'budget_samples': budget_samples, 'epochs': epochs, 'max_steps': self.scheduler_steps}
        args.max_steps = steps_to_budget(0, 0, loader.epoch_size, epochs, 1, entries)
        values['loop_bound'] = args.max_steps
        self.decisions.write(DecisionRecord('integration', 'max_steps', reason, values,
                                            message.format(steps=self.scheduler_steps)))

    def refresh(self, state: Any, loader: Any, reason: str) -> int | None:
        """Set ``state.max_steps`` to the steps the budget needs at the current batch size; returns the new total
        when it changed (the caller stretches the LR schedule to it), else ``None``. Collective (under several
        processes, every rank calls it at the same step boundary)."""
        if self.epoch_budget is None or loader is None:
            return None
        needed = state.global_step + loader.steps_to_budget(self.epoch_budget)
        if needed == state.max_steps:
            return None
        old, state.max_steps = state.max_steps, needed
        self.sync_progress_bars(needed)
        if reason != 'start':
            self.decisions.write(DecisionRecord('integration', 'max_steps', reason, {'old': old, 'new': needed},
                                       f'the epoch budget needs {needed} steps at batch size {loader.batch_size}'))
        return needed

    def sync_progress_bars(self, total: int) -> None:
        """Set the total of the trainer's progress bars (HF's ``ProgressCallback``, ms-swift's
        ``ProgressCallbackNew``: a tqdm in ``training_bar``) to ``total``: the bar follows every ``max_steps``
        change, up or down, and a run that ends early ends at N/N."""
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, 'training_bar', None)
            if bar is not None and getattr(bar, 'total', None) != total:
                bar.total = total
                bar.refresh()

    def after_step(self, state: Any, control: Any, loader: Any) -> None:
        """``on_step_end``: an honest ``state.epoch``, the HF epoch ends with the data epoch, the budget stops."""
        state.epoch = loader.epoch_progress
        if loader.epoch_complete:
            control.should_epoch_stop = True
        if self.epoch_budget is not None and not before(loader.epoch_progress, self.epoch_budget):
            if not control.should_training_stop:
                self.decisions.write(DecisionRecord('integration', 'stop', self.reason, {'epochs': self.epoch_budget},
                                           f'{self.epoch_budget:.6g} epochs of data used'))
            control.should_training_stop = True
