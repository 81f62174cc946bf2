"""Multi-process ``swift sft`` runs on CPU under a named engine, and the one-process reference they are compared with.

:func:`run_ranks` launches ``tests/distributed_driver.py`` on several ranks (gloo, ``use_cpu: true``: without it
accelerate runs ``DistributedType.NO`` and the ranks train separate copies) with the engine's settings from
:data:`ENGINES`, under a timeout that kills the whole process group. On CPU the ranks are forked from one process that
imported ms-swift once (``tests/fork_launch.py``: the import is about 12 s of CPU a process on 2 cores); on GPUs
(``SDC_ENGINE_DEVICE=cuda``) they start under ``torch.distributed.run``. :func:`reference` runs one process over the
same micro-batches per step (the union of the ranks'), from the same starting weights, with the same LR scales (the
multi-process run's ``applied_request`` records replayed): the trainable weights of a correct engine equal it.
On CPU both commands are forked from one server per pytest worker that imported ms-swift once
(``tests/fork_server.py``: about 8 s of CPU saved a run); ``SDC_FORK_SERVER=0`` starts each as a fresh process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from swift_runs import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, 'distributed_driver.py')
FORK_LAUNCH = os.path.join(HERE, 'fork_launch.py')
FORK_SERVER = os.path.join(HERE, 'fork_server.py')
#: seconds for the fork server to import ms-swift, or to fork a run
STARTUP_S = 180
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
    port = free_port() if nproc > 1 else 0
    if nproc > 1 and DEVICE == 'cpu':  # the ranks forked after one import of ms-swift (tests/fork_launch.py)
        command = [sys.executable, FORK_LAUNCH, str(nproc), str(port), spec_path]
    elif nproc > 1:
        command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc), '--master_addr',
                   '127.0.0.1', '--master_port', str(port), DRIVER, spec_path]
    else:
        command = [sys.executable, DRIVER, spec_path]
    log = os.path.join(workdir, 'run.log')
    start = time.monotonic()
    server = _server(env) if DEVICE == 'cpu' else None
    if server is not None:  # the same command, forked from this worker's server (tests/fork_server.py)
        rc = server.run({'nproc': nproc, 'port': port, 'spec': spec_path, 'cwd': workdir, 'log': log, 'env': env},
                        timeout, log)
    else:
        rc = _run_command(command, env, workdir, log, timeout, nproc)
    if expect_failure:
        assert rc != 0, f'the run was expected to fail but exited 0:\n{_tail(log)}'
    else:
        assert rc == 0, f'exited {rc} after {time.monotonic() - start:.0f}s:\n{_tail(log)}'
    return log


def _run_command(command: list[str], env: dict[str, str], workdir: str, log: str, timeout: int, nproc: int) -> int:
    with open(log, 'w') as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f'{nproc}-process run did not finish in {timeout}s (a hang?); last output:\n{_tail(log)}')
    return rc


class ForkServer:
    """The client of this worker's ``tests/fork_server.py``: one run at a time, its exit status."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = _import_env(env)
        self.errors = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.errors, env=env, cwd=HERE, bufsize=0)
        self.buffer = b''
        if self._message(STARTUP_S) is None:
            self.process.kill()
            self.errors.seek(0)
            raise RuntimeError(f'tests/fork_server.py did not start:\n{self.errors.read().decode(errors="replace")}')

    def alive(self) -> bool:
        return self.process.poll() is None

    def _message(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while b'\n' not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b'\n', 1)
        return json.loads(line)

    def run(self, request: dict[str, Any], timeout: int, log: str) -> int:
        self.process.stdin.write((json.dumps(request) + '\n').encode())
        self.process.stdin.flush()
        started = self._message(STARTUP_S)
        if started is None:
            pytest.fail(f'the fork server did not start a run:\n{_tail(log)}')
        ended = self._message(timeout)
        if ended is None:
            os.killpg(started['pid'], signal.SIGKILL)
            self._message(STARTUP_S)  # the server reaps it
            pytest.fail(f'{request["nproc"]}-process run did not finish in {timeout}s (a hang?); last output:\n'
                        f'{_tail(log)}')
        return int(ended['code'])


def _import_env(env: dict[str, str]) -> dict[str, str]:
    """What of a run's environment its imports may read: all of it but pytest's name of the running test."""
    return {k: v for k, v in env.items() if k != 'PYTEST_CURRENT_TEST'}


_SERVER: ForkServer | None = None


def _server(env: dict[str, str]) -> ForkServer | None:
    """This worker's fork server, started on its first CPU run; ``None`` (a fresh process) for a run whose environment
    is not the one the server imported under, or with ``SDC_FORK_SERVER=0``."""
    global _SERVER
    if os.environ.get('SDC_FORK_SERVER', '1') == '0':
        return None
    if _SERVER is None or not _SERVER.alive():
        _SERVER = ForkServer(env)
    return _SERVER if _import_env(env) == _SERVER.env else None


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
