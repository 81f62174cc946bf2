"""Start the ranks of a multi-process test run as forks of one process that has already imported ms-swift.

``python tests/fork_launch.py NPROC PORT SPEC`` imports ms-swift, the pack and ``distributed_driver`` once (about 12 s
of CPU a process on a 2-core machine: most of a short engine run's start), then forks ``NPROC`` ranks that each set
the environment ``torch.distributed.run`` gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and run ``distributed_driver.main(SPEC)``. Like
``torch.distributed.run``, the first rank to fail makes it stop the others (SIGTERM, then SIGKILL after
:data:`GRACE_S`) and exit non-zero. Used by ``engine_runs.launch`` on CPU only (the GPU engine runs keep
``torch.distributed.run``: no process may fork after CUDA starts); the user's route
(``NPROC_PER_NODE=2 swift-dynamic sft``, torchrun under ms-swift) is tested by ``tests/test_balanced_ddp.py`` and
``tests/test_cli_yaml.py``.

Nothing the forked ranks share is a rank's own: the parent starts no process group, no thread pool (one OpenMP thread,
``OMP_NUM_THREADS=1``) and no device, and each rank patches its own copies of the classes the driver patches. What
ms-swift decides at import from the environment is its logger's level (rank 0's everywhere: more log lines from rank
1, nothing else). Every engine test asserts each rank's distributed type and wrapper (``engine_runs.assert_engine``),
so a rank that silently trained alone would fail it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

#: seconds between SIGTERM and SIGKILL once a rank failed (torch.distributed.run waits 30): the run's outcome is decided
#: and every rank writes unbuffered; a rank blocked in a gloo collective (DeepSpeed's start-up) never sees SIGTERM, so
#: 30 s here were 50 of the 74 s of the ZeRO-3 refusal test
GRACE_S = 5


def _run_rank(rank: int, nproc: int, port: int, spec_path: str) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK='0', ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    import distributed_driver
    try:
        distributed_driver.main(spec_path)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank's failure is printed and becomes its exit status
        print(f'[rank{rank}]: ' + traceback.format_exc().replace('\n', f'\n[rank{rank}]: '), file=sys.stderr)
        return 1
    return 0


def main(nproc: int, port: int, spec_path: str) -> int:
    """Fork ``nproc`` ranks (they stay in this process's group: one kill of the group ends them all); the exit
    status of the first rank that failed, else 0."""
    import json
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    with open(spec_path, encoding='utf-8') as f:
        if json.load(f).get('engine') == 'deepspeed':
            import deepspeed  # noqa: F401
    import swift.pipelines  # noqa: F401 - the import every rank would otherwise make again
    import swift_dynamic_callbacks.integrations.swift  # noqa: F401
    import distributed_driver  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_rank(rank, nproc, port, spec_path)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.wait()
        if pid not in children:
            continue
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 1
            print(f'fork_launch: rank {rank} exited {code}: stopping the other ranks', file=sys.stderr, flush=True)
            _stop(children)
    return failed


def _stop(children: dict[int, int]) -> None:
    for pid in children:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while children and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.2)
        else:
            children.pop(pid, None)
    for pid in children:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


if __name__ == '__main__':
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
