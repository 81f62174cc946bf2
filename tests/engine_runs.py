"""Multi-process ``swift sft`` runs on CPU under a named engine, and the one-process reference they are compared with.

:func:`run_ranks` launches ``tests/distributed_driver.py`` on several ranks (gloo, ``use_cpu: true``: without it
accelerate runs ``DistributedType.NO`` and the ranks train separate copies) with the engine's settings from
:data:`ENGINES`, under a timeout that kills the whole process group. On CPU the ranks are forked from one process that
imported ms-swift once (``tests/fork_launch.py``: the import is about 12 s of CPU a process on 2 cores); on GPUs
(``SDC_ENGINE_DEVICE=cuda``) they start under ``torch.distributed.run``. :func:`reference` runs one process over the
same micro-batches per step (the union of the ranks'), from the same starting weights, with the same LR scales (the
multi-process run's ``applied_request`` records replayed): the trainable weights of a correct engine equal it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from swift_runs import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, 'distributed_driver.py')
FORK_LAUNCH = os.path.join(HERE, 'fork_launch.py')
CONFIGS = os.path.join(HERE, 'engine_configs')
TIMEOUT_S = 300
#: ``cpu`` (default: gloo, ``use_cpu: true``) or ``cuda`` (NCCL on 2+ GPUs: ``scripts/gpu_engines.sh``)
DEVICE = os.environ.get('SDC_ENGINE_DEVICE', 'cpu')
DEVICE_SFT: dict[str, Any] = {'use_cpu': True, 'ddp_backend': 'gloo'} if DEVICE == 'cpu' else {'ddp_backend': 'nccl'}
ONE_PROCESS_SFT: dict[str, Any] = {'use_cpu': True} if DEVICE == 'cpu' else {}  # no process group to set up
#: what a test engine name means: ms-swift settings, the driver's engine, accelerate's distributed type, wrapper class
ENGINES: dict[str, dict[str, Any]] = {
    'ddp': {'sft': {}, 'driver': 'ddp', 'type': 'MULTI_CPU' if DEVICE == 'cpu' else 'MULTI_GPU',
            'wrapper': 'DistributedDataParallel'},
    'fsdp2': {'sft': {'fsdp': os.path.join(CONFIGS, 'fsdp2_cpu.json')}, 'driver': 'fsdp2', 'type': 'FSDP',
              'wrapper': 'FSDPPeftModelForCausalLM'},
    'zero2': {'sft': {'deepspeed': os.path.join(CONFIGS, 'zero2_cpu.json'), 'fp16': False, 'bf16': False},
              'driver': 'deepspeed', 'type': 'DEEPSPEED', 'wrapper': 'DeepSpeedEngine'},
    'zero3': {'sft': {'deepspeed': os.path.join(CONFIGS, 'zero3_cpu.json'), 'fp16': False, 'bf16': False},
              'driver': 'deepspeed', 'type': 'DEEPSPEED', 'wrapper': 'DeepSpeedEngine'},
}
RANK_LOCAL = ('best', 'value', 'wait', 'grad_norm', 'rank', 'position')


def _tail(path: str, lines: int = 60) -> str:
    with open(path, errors='replace') as f:
        return ''.join(f.readlines()[-lines:])


def launch(workdir: str, spec: dict[str, Any], *, nproc: int, timeout: int = TIMEOUT_S,
           expect_failure: bool = False) -> str:
    """Run the driver with ``spec`` on ``nproc`` processes; return the log. Kills the process group on timeout."""
    os.makedirs(workdir, exist_ok=True)
    spec_path = os.path.join(workdir, 'spec.json')
    with open(spec_path, 'w', encoding='utf-8') as f:
        json.dump(spec, f)
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false', 'PYTHONUNBUFFERED': '1',
           'PYTHONPATH': os.pathsep.join(p for p in (HERE, os.environ.get('PYTHONPATH')) if p)}
    if nproc > 1 and DEVICE == 'cpu':  # the ranks forked after one import of ms-swift (tests/fork_launch.py)
        command = [sys.executable, FORK_LAUNCH, str(nproc), str(free_port()), spec_path]
    elif nproc > 1:
        command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc), '--master_addr',
                   '127.0.0.1', '--master_port', str(free_port()), DRIVER, spec_path]
    else:
        command = [sys.executable, DRIVER, spec_path]
    log = os.path.join(workdir, 'run.log')
    start = time.monotonic()
    with open(log, 'w') as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f'{nproc}-process run did not finish in {timeout}s (a hang?); last output:\n{_tail(log)}')
    if expect_failure:
        assert rc != 0, f'the run was expected to fail but exited 0:\n{_tail(log)}'
    else:
        assert rc == 0, f'exited {rc} after {time.monotonic() - start:.0f}s:\n{_tail(log)}'
    return log


def arch_of(model: str) -> str:
    """The tiny model's architecture (``tiny.MODEL_FLAGS`` key: its template) from its folder's ``config.json``."""
    with open(os.path.join(model, 'config.json'), encoding='utf-8') as f:
        return json.load(f)['model_type']


def run_ranks(workdir: str, model: str, dataset: str, *, engine: str, callbacks: list[str], pack: dict[str, Any],
              faults: dict[str, Any] | None = None, output_dir: str | None = None, expect_failure: bool = False,
              stop_at: int | None = None, nproc: int = 2, arch: str | None = None, **sft: Any) -> str:
    """``nproc`` ranks under ``engine`` (a key of :data:`ENGINES`) training the tiny ``model`` (as ``arch``, by
    default its own); returns the output directory (or the log on failure)."""
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    out = output_dir or os.path.join(workdir, 'out')
    kwargs = offline_sft_kwargs(model, dataset, out, arch=arch or arch_of(model), callbacks=callbacks,
                                lora_dropout=0.0,
                                **{**(DEVICE_SFT if nproc > 1 else ONE_PROCESS_SFT), **ENGINES[engine]['sft'], **sft})
    spec = {'sft': kwargs, 'pack': pack, 'faults': faults or {}, 'engine': ENGINES[engine]['driver'],
            'stop_at': stop_at}
    log = launch(workdir, spec, nproc=nproc, expect_failure=expect_failure)
    return log if expect_failure else out


def reference(workdir: str, model: str, dataset: str, source: str, *, gradient_accumulation_steps: int,
              max_steps: int, world: int = 2, stop_at: int | None = None, samples: list[str] | None = None,
              arch: str | None = None, **sft: Any) -> str:
    """One process over the multi-process run ``source``'s micro-batches (or those of the trace files
    ``samples``), starting weights and LR scales."""
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    out = os.path.join(workdir, 'out')
    pack = {'integration': {'record_samples': True, 'replay': os.path.join(source, 'dynamic_decisions.jsonl')},
            'training_log': {}}
    kwargs = offline_sft_kwargs(model, dataset, out, arch=arch or arch_of(model), callbacks=['training_log'],
                                lora_dropout=0.0,
                                gradient_accumulation_steps=gradient_accumulation_steps * world, max_steps=max_steps,
                                **({'use_cpu': True} if DEVICE == 'cpu' else {}), **sft)
    spec = {'sft': kwargs, 'pack': pack, 'engine': 'single',
            'replay_samples': samples or [os.path.join(source, f'dynamic_samples.rank{r}.jsonl')
                                          for r in range(world)],
            'initial_weights': os.path.join(source, 'rank0.initial.pt'), 'stop_at': stop_at}
    launch(workdir, spec, nproc=1)
    return out


def traces(out: str, world: int = 2) -> list[dict[str, Any]]:
    found = []
    for rank in range(world):
        with open(os.path.join(out, f'rank{rank}.trace.json'), encoding='utf-8') as f:
            found.append(json.load(f))
    assert [t['world_size'] for t in found] == [world] * world
    return found


def assert_engine(out: str, engine: str) -> list[dict[str, Any]]:
    """Every rank trained under the engine it claims (no silent fallback); returns the traces."""
    found = traces(out)
    expected = ENGINES[engine]
    for t in found:
        assert (t['distributed_type'], t['wrapper'], t['engine']) == (
            expected['type'], expected['wrapper'], expected['driver']), t
    return found


def weights(out: str, rank: int = 0, name: str = 'weights') -> dict[str, Any]:
    import torch
    return torch.load(os.path.join(out, f'rank{rank}.{name}.pt'))


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_weights(out: str, ref: str | None = None, *, atol: float = 1e-5) -> None:
    """The ranks' trainable weights are equal, differ from where they started, and (with ``ref``) equal the
    one-process reference's."""
    w0, w1 = weights(out, 0), weights(out, 1)
    assert max_difference(w0, w1) <= 1e-7, 'the ranks\' weights differ'
    assert max_difference(w0, weights(out, 0, 'initial')) > 1e-4, 'training did not change the weights'
    if ref is not None:
        difference = max_difference(w0, weights(ref, 0))
        assert difference <= atol, f'{difference:.3g} from the one-process run with the same samples per step'


def assert_same_steps(t0: dict[str, Any], t1: dict[str, Any]) -> None:
    """Both ranks applied the same batch size, pieces, pass cap and LR at every step."""
    keys = ('step', 'batch_size', 'num_pieces', 'pass_limit', 'lr')
    assert [[s[k] for k in keys] for s in t0['steps']] == [[s[k] for k in keys] for s in t1['steps']]
    assert t0['global_step'] == t1['global_step']


def decision_keys(trace: dict[str, Any], *, skip_kinds: tuple[str, ...] = ()) -> list[tuple]:
    """A rank's decisions without wall-clock time, messages and values measured on that rank."""
    keys = []
    for d in trace['decisions']:
        if d['kind'] in skip_kinds:
            continue
        values = {k: v for k, v in d['values'].items() if k not in RANK_LOCAL and not k.startswith('memory_')}
        keys.append((d['step'], d['source'], d['kind'], d['reason'], json.dumps(values, sort_keys=True)))
    return keys


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """``build(folder)`` once per test run; its result (JSON) is returned to every caller. Under pytest-xdist the
    workers share the folder (the run's base temporary folder): the first to come builds it while the others wait on a
    file lock, then they read its result; a build that fails leaves nothing, and the next caller tries again. Without
    xdist the folder is this process's own."""
    from filelock import FileLock
    if 'PYTEST_XDIST_WORKER' not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / name  # a worker's base is <the run's base>/popen-gw<N>
    with FileLock(f'{folder}.lock'):
        done = folder / 'result.json'
        if not done.exists():
            folder.mkdir(exist_ok=True)
            result = build(folder)
            done.write_text(json.dumps(result), encoding='utf-8')
        return json.loads(done.read_text(encoding='utf-8'))
