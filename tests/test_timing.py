"""The shared step timer (swift_dynamic_callbacks.testing.timing.StepTimer): its marks, its figures, the one flag it
sets, and its factory."""
from transformers import TrainerControl, TrainerState, TrainingArguments

from swift_dynamic_callbacks.testing.timing import StepTimer


def _drive(timer: StepTimer, steps: int) -> list[bool]:
    """Call the hooks as the HF loop does; the stop flag after each step's end."""
    args, state = TrainingArguments(output_dir='unused', use_cpu=True), TrainerState()
    stops = []
    timer.on_train_begin(args, state, TrainerControl())
    for _ in range(steps):
        control = TrainerControl()
        timer.on_step_begin(args, state, control)
        timer.on_step_end(args, state, control)
        stops.append(control.should_training_stop)
    timer.on_train_end(args, state, TrainerControl())
    return stops


def test_the_timer_marks_every_step_and_its_figures_follow_from_the_marks():
    timer = StepTimer()
    assert _drive(timer, 3) == [False, False, False]
    assert len(timer.step_begins) == len(timer.step_ends) == 3
    assert [round(x, 9) for x in timer.step_seconds()] == [
        round(end[0] - begin[0], 9) for begin, end in zip(timer.step_begins, timer.step_ends)]
    intervals = timer.intervals()
    assert len(intervals) == 3 and all(x >= 0 for x in intervals)
    assert intervals[0] == timer.step_ends[0][0] - timer.train_begin[0]
    assert timer.total is not None and timer.total >= sum(timer.step_seconds())


def test_stop_after_requests_the_stop_at_that_step_end_only_from_then_on():
    assert _drive(StepTimer(stop_after=2), 3) == [False, True, True]


def test_the_factory_keeps_each_timer_it_builds():
    factory = StepTimer.factory(stop_after=1)
    try:
        factory.last
    except ValueError as e:
        assert 'callbacks' in str(e)
    else:
        raise AssertionError('an empty factory has no last timer')
    first, second = factory(None, None), factory(None, None)
    assert factory.timers == [first, second] and factory.last is second and second.stop_after == 1
