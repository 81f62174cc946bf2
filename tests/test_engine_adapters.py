"""The engine adapters and the engine x feature table, with fakes (no training): what each engine refuses, how each
runs a pass, what a rank without samples runs, how DDP repairs its state after an OOM and reduces gradients."""

from __future__ import annotations

import types

import pytest
import torch

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.engines import (ENGINES, check_engine, engine_from_swift, refusals,
                                                     requested_features, unsupported)
from swift_dynamic_callbacks.integrations.engines import (DDPEngine, DeepSpeedEngineAdapter, Engine, FSDP2Engine,
                                                          engine_name, select_engine, zero_weight_batch)
from swift_dynamic_callbacks.integrations.engines.ddp import all_reduce_gradients
from swift_runs import free_port

FEATURES = ('pieces', 'pass_limit', 'noise_scale', 'oom_recovery')


# ---- the table ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('feature', FEATURES)
def test_table_every_engine_and_feature(engine, feature):
    """One process and DDP run every feature; FSDP2 and DeepSpeed run pieces and pass caps (every rank the same
    number of passes) and refuse the two that need a rank to run a pass again or read a pass's gradient, each with a
    reason."""
    reason = unsupported(engine, feature)
    if engine in ('single', 'ddp') or feature in ('pieces', 'pass_limit'):
        assert reason is None
    else:
        assert reason and ('collective' in reason or 'gradient' in reason)


def test_engine_from_swift_settings():
    assert engine_from_swift({'deepspeed': 'zero2'}) == 'deepspeed'
    assert engine_from_swift({'fsdp': 'fsdp2'}) == 'fsdp2'
    assert engine_from_swift({'fsdp': 'full_shard', 'fsdp_config': {'fsdp_version': 2}}) == 'fsdp2'
    assert engine_from_swift({'per_device_train_batch_size': 2}) is None
    with pytest.raises(ConfigError, match='FSDP1'):
        engine_from_swift({'fsdp': 'full_shard', 'fsdp_config': {'fsdp_version': 1}})


def test_requested_features_read_the_pack_section():
    pack = {'batch_growth': {'micro_batch_cap': 2, 'policy': 'noise_scale'}, 'memory_backoff': {},
            'integration': {'oom_recovery': True}}
    assert requested_features(pack, ['batch_growth', 'memory_backoff']) == {
        'pieces': 'dynamic_callbacks.batch_growth.micro_batch_cap',
        'noise_scale': 'dynamic_callbacks.batch_growth.policy',
        'pass_limit': 'callbacks: memory_backoff',
        'oom_recovery': 'dynamic_callbacks.integration.oom_recovery'}
    assert requested_features(pack, []) == {'oom_recovery': 'dynamic_callbacks.integration.oom_recovery'}
    assert requested_features({'integration': {'oom_recovery': 'auto'}}, []) == {}
    log = {'training_log': {'noise_scale': True}}
    assert requested_features(log, ['training_log']) == {'noise_scale': 'dynamic_callbacks.training_log.noise_scale'}
    assert requested_features(log, []) == {}
    with pytest.raises(ConfigError, match='dynamic_callbacks.training_log.noise_scale'):
        check_engine('deepspeed', log, ['training_log'])


@pytest.mark.parametrize('engine', ['fsdp2', 'deepspeed'])
def test_check_engine_names_every_refused_setting(engine):
    """Pieces and pass caps run under sharded engines (the same number of passes on every rank); the noise-scale
    probe and OOM recovery do not, each named."""
    pack = {'batch_growth': {'micro_batch_cap': 2, 'policy': 'noise_scale'}, 'memory_backoff': {},
            'integration': {'oom_recovery': True}}
    with pytest.raises(ConfigError) as e:
        check_engine(engine, pack, ['batch_growth', 'memory_backoff'])
    message = str(e.value)
    assert 'dynamic_callbacks.batch_growth.policy: noise_scale is not supported under ' + engine in message
    assert 'dynamic_callbacks.integration.oom_recovery: oom_recovery is not supported under ' + engine in message
    assert 'micro_batch_cap' not in message and 'memory_backoff' not in message
    check_engine(engine, {'batch_growth': {'micro_batch_cap': 2}, 'memory_backoff': {}},
                 ['batch_growth', 'memory_backoff'])  # no error
    check_engine('ddp', pack, ['batch_growth', 'memory_backoff'])  # no error
    assert refusals(None, pack, ['memory_backoff']) == []


@pytest.mark.parametrize('engine_args,section,listed,words', [
    ({'deepspeed': {'zero_optimization': {'stage': 3}}}, {'integration': {'oom_recovery': True}}, [],
     'dynamic_callbacks.integration.oom_recovery: oom_recovery is not supported under deepspeed'),
    ({'fsdp': 'full_shard auto_wrap', 'fsdp_config': {'fsdp_version': 2}},
     {'batch_growth': {'policy': 'noise_scale', 'initial': 1, 'maximum': 2}}, ['batch_growth'],
     'dynamic_callbacks.batch_growth.policy: noise_scale is not supported under fsdp2'),
    ({'fsdp': 'full_shard auto_wrap', 'fsdp_config': {'fsdp_version': 1}}, {}, [], 'FSDP1'),
])
def test_the_plugin_route_refuses_the_engines_features_before_the_model_loads(monkeypatch, engine_args, section,
                                                                               listed, words):
    """``swift sft`` / Python runs: ms-swift's parsed arguments (``deepspeed`` a dict, ``fsdp`` its options and
    ``fsdp_config``) name the engine, and ``check_pipeline`` (run before ``_prepare_model_tokenizer``) refuses what
    it cannot run, as ``swift-dynamic check`` does on the YAML (it was refused when training started, after every rank
    had loaded the model); without an engine, or with a feature the engine runs, nothing is refused."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.integrations import swift as plugin
    monkeypatch.setattr(plugin, '_active', True)
    monkeypatch.setattr(plugin, '_configured', plugin.parse_section(section))
    with pytest.raises(ConfigError, match=words):
        plugin.check_pipeline(SimpleNamespace(callbacks=listed, **engine_args))
    plugin.check_pipeline(SimpleNamespace(callbacks=listed, deepspeed=None, fsdp=[], fsdp_config={}))
    monkeypatch.setattr(plugin, '_configured', plugin.parse_section({'batch_growth': {'micro_batch_cap': 1}}))
    plugin.check_pipeline(SimpleNamespace(callbacks=['batch_growth'], deepspeed={'zero_optimization': {'stage': 3}},
                                          fsdp=[], fsdp_config={}))  # pieces run under every engine


# ---- choosing the adapter ----------------------------------------------------------------------------------------
def fake_trainer(kind: str, world: int = 2, fsdp_version: int = 2, oom: bool = True):
    from accelerate.utils import DistributedType
    state = types.SimpleNamespace(fsdp_plugin=types.SimpleNamespace(fsdp_version=fsdp_version),
                                  deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    accelerator = types.SimpleNamespace(distributed_type=getattr(DistributedType, kind), state=state,
                                        gradient_state=FakeGradientState())
    return types.SimpleNamespace(accelerator=accelerator, args=types.SimpleNamespace(world_size=world))


class FakeGradientState:
    def __init__(self) -> None:
        self.sync_gradients = True

    def _set_sync_gradients(self, value: bool) -> None:
        self.sync_gradients = value


@pytest.mark.parametrize('kind,world,expected', [('NO', 1, 'single'), ('MULTI_CPU', 2, 'ddp'),
                                                 ('MULTI_GPU', 4, 'ddp'), ('MULTI_GPU', 1, 'single'),
                                                 ('FSDP', 2, 'fsdp2'), ('DEEPSPEED', 2, 'deepspeed')])
def test_engine_name(kind, world, expected):
    assert engine_name(fake_trainer(kind, world)) == expected


def test_several_processes_without_ddp_are_refused():
    """ms-swift with ``ddp_backend: gloo`` on CPU and no ``use_cpu``: accelerate runs DistributedType.NO, each rank
    would train its own copy. The pack refuses it instead of training the wrong thing."""
    with pytest.raises(ConfigError, match='use_cpu: true'):
        engine_name(fake_trainer('NO', 2))
    with pytest.raises(ConfigError, match='FSDP1'):
        engine_name(fake_trainer('FSDP', 2, fsdp_version=1))


def test_select_engine_and_oom_recovery_setting():
    single, recovery, _ = select_engine(fake_trainer('NO', 1), 'auto')
    assert type(single) is Engine and recovery
    ddp, recovery, why = select_engine(fake_trainer('MULTI_CPU'), 'auto')
    assert isinstance(ddp, DDPEngine) and ddp.sync == 'deferred' and recovery and why is None
    native, recovery, why = select_engine(fake_trainer('MULTI_CPU'), False)
    assert native.sync == 'native' and not recovery and why == 'off by setting'
    for kind, cls in (('FSDP', FSDP2Engine), ('DEEPSPEED', DeepSpeedEngineAdapter)):
        engine, recovery, why = select_engine(fake_trainer(kind), 'auto')
        assert isinstance(engine, cls) and not recovery and 'collective' in why
        with pytest.raises(ConfigError, match=f'oom_recovery: true is not supported under {engine.name}'):
            select_engine(fake_trainer(kind), True)
        engine.refuse('pieces', 'control.new_num_pieces')  # every rank runs the same number of passes
        assert engine.collective_passes
        with pytest.raises(ConfigError, match='control.measure_grad_noise: noise_scale is not supported'):
            engine.refuse('noise_scale', 'control.measure_grad_noise')
    Engine(fake_trainer('NO', 1)).refuse('pieces', 'anything')  # one process: nothing refused


# ---- passes --------------------------------------------------------------------------------------------------------
class FakeFSDPModel:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.calls.append(value)


def test_fsdp2_reduce_scatters_every_pass():
    """Every pass reduce-scatters its gradients (inside a micro-batch that HF wrapped in ``no_sync`` too): no
    full-size unsharded gradient is held across a step's passes, whatever their number."""
    engine, model = FSDP2Engine(fake_trainer('FSDP')), FakeFSDPModel()
    for sync in (False, False, True):
        with engine.pass_context(model, sync=sync):
            pass
    assert model.calls == [True, True, True]


def test_deepspeed_marks_only_the_last_pass_as_the_boundary():
    trainer = fake_trainer('DEEPSPEED')
    engine = DeepSpeedEngineAdapter(trainer)
    state = trainer.accelerator.gradient_state
    seen = []
    for sync in (False, True):
        with engine.pass_context(None, sync=sync):
            seen.append(state.sync_gradients)
    assert seen == [False, True] and state.sync_gradients is True
    assert engine.describe()['zero_stage'] == 3


def test_zero_weight_batch_is_one_ignored_row():
    template = {'input_ids': torch.arange(12).view(3, 4), 'attention_mask': torch.ones(3, 4, dtype=torch.long),
                'labels': torch.arange(12).view(3, 4), 'position_ids': torch.arange(4).view(1, 4), 'flag': True}
    batch = zero_weight_batch(template)
    assert batch['input_ids'].tolist() == [[0, 1, 2, 3]] and batch['labels'].tolist() == [[-100] * 4]
    assert batch['position_ids'].shape == (1, 4) and batch['flag'] is True
    assert template['labels'][0].tolist() == [0, 1, 2, 3]  # the template is not changed
    with pytest.raises(RuntimeError, match='labels'):
        zero_weight_batch({'input_ids': torch.zeros(2, 3)})


def test_a_packed_template_gives_its_first_row_not_the_whole_pass():
    """A rank without samples copies its last real pass; a padding-free pass is one [1, N] row of many rows, and a
    placeholder of all N tokens would cost a whole pass on the idle rank: it takes the first packed row only."""
    from swift_dynamic_callbacks.integrations.padding_free import flatten_rows
    rows = [torch.arange(1, n + 1) for n in (6, 4, 3)]
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, :len(row)], mask[k, :len(row)] = row, 1
    packed = flatten_rows({'input_ids': ids, 'attention_mask': mask, 'labels': ids.clone()})
    batch = zero_weight_batch(packed)
    assert batch['input_ids'].tolist() == [[1, 2, 3, 4, 5, 6]] and batch['labels'].tolist() == [[-100] * 6]
    assert batch['position_ids'].tolist() == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize('engine_cls,kind', [(FSDP2Engine, 'FSDP'), (DeepSpeedEngineAdapter, 'DEEPSPEED')])
def test_sharded_placeholders_run_a_zero_weight_pass(engine_cls, kind):
    engine = engine_cls(fake_trainer(kind))
    ran = []
    loss = engine.placeholder_pass(FakeFSDPModel(), lambda batch: ran.append(batch) or torch.tensor(0.0),
                                   {'input_ids': torch.ones(2, 3, dtype=torch.long),
                                    'labels': torch.ones(2, 3, dtype=torch.long)}, sync=True)
    assert float(loss) == 0.0 and len(ran) == 1 and ran[0]['labels'].tolist() == [[-100] * 3]
    with pytest.raises(RuntimeError, match='no template'):
        engine.placeholder_pass(FakeFSDPModel(), lambda batch: None, None, sync=False)


def test_ddp_placeholders_run_nothing_unless_native_sync_needs_them():
    deferred = DDPEngine(fake_trainer('MULTI_CPU'), sync='deferred')
    native = DDPEngine(fake_trainer('MULTI_CPU'), sync='native')
    template = {'input_ids': torch.ones(1, 2, dtype=torch.long), 'labels': torch.ones(1, 2, dtype=torch.long)}
    assert deferred.placeholder_pass(None, lambda b: 1 / 0, template, sync=True) is None
    assert native.placeholder_pass(None, lambda b: 1 / 0, template, sync=False) is None


class FakeDDP:
    def __init__(self) -> None:
        self.require_forward_param_sync = True


def test_ddp_after_oom_clears_the_pending_buffer_broadcast_only_when_forward_started():
    """The first-forward deadlock: DDP broadcasts buffers before calling the module; a forward that failed inside the
    module never cleared the request, so the retry broadcast again while the other rank waited elsewhere."""
    engine, model = DDPEngine(fake_trainer('MULTI_CPU')), FakeDDP()
    engine._forward_started = False
    engine.after_oom(model)  # failed before DDP's forward ran (e.g. moving inputs): its broadcast is still owed
    assert model.require_forward_param_sync is True
    engine._forward_started = True
    engine.after_oom(model)
    assert model.require_forward_param_sync is False and engine._forward_started is False


def _reduce_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2)
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3, 2)),
              torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2))]
    for i, p in enumerate(params[:3]):
        p.grad = torch.full_like(p, float(rank + 1 + i))
    all_reduce_gradients(params, bucket_bytes=24)  # several buckets, a dtype change, a missing gradient
    results[rank] = [p.grad.tolist() for p in params]
    dist.destroy_process_group()


def test_all_reduce_gradients_averages_in_buckets():
    import torch.multiprocessing as mp
    port = free_port()
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_reduce_worker, args=(port, results), nprocs=2, join=True)
    assert results[0] == results[1]
    grads = results[0]
    assert grads[0] == [1.5] * 5 and grads[1] == [[2.5, 2.5]] * 3 and grads[2] == [3.5] * 4 and grads[3] == [0.0, 0.0]


def test_a_placeholder_pass_adds_a_plain_zero_to_the_logged_loss():
    """The loss of a row whose labels are all ignored is NaN (a mean over no tokens); what a placeholder micro-batch
    returns is added to HF's logged training loss, so it must be a plain zero (a NaN made a sharded engine's run stop
    early with reason ``non_finite``)."""
    from swift_dynamic_callbacks.integrations.steps import StepRunner
    from swift_dynamic_callbacks.data.slots import EmptyMicroBatch

    class NaNPlaceholderEngine(Engine):
        def check_wrapped(self, model):
            pass

        def placeholder_pass(self, model, run, template, *, sync):
            return run(template)

    trainer = fake_trainer('FSDP')
    trainer.args = types.SimpleNamespace(device=torch.device('cpu'))
    runner = StepRunner(trainer, NaNPlaceholderEngine(trainer), oom_recovery=False,
                        single_sample_retries=0)
    runner.start_step([([], EmptyMicroBatch()), ([], EmptyMicroBatch())], None)
    loss = runner.run_micro_batch(None, EmptyMicroBatch(), lambda batch: torch.tensor(float('nan')), None)
    assert torch.isfinite(loss) and float(loss) == 0.0
