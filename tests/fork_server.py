"""One process per pytest worker that imports ms-swift's training stack once and forks every CPU run of
``engine_runs.launch`` from it.

Each engine test starts two to four runs, each a new Python that imported ms-swift, the pack and the driver again:
about 8 s of CPU a run on 2 cores, and the runs themselves take 10-30 s. Here the imports happen once; a run is a
fork of this process that sets the run's environment, working directory and log, then does exactly what the command
it replaces did: ``fork_launch.main`` (the ranks, forked in turn) or, for one process, ``distributed_driver.main``.
The fork is a session leader, so ``launch`` kills a hung run's whole group as before.

Protocol, one JSON object a line: the client writes ``{"nproc", "port", "spec", "cwd", "log", "env"}``; the server
answers ``{"pid"}`` when the run started and ``{"pid", "code"}`` when it ended (its exit status). The server ends at
the end of its input (its pytest worker is gone).

What a run shares with this process is only what it imported, under the environment the server started with:
``engine_runs`` starts a fresh process instead of using the server when a run's environment differs from it, so
nothing decided at import time (ms-swift's logger level, ``datasets``' settings) can differ from a fresh process's.
Nothing else is shared: the server starts no thread pool, process group or device (``fork_launch``'s conditions).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _preimport() -> None:
    """What ``fork_launch`` imports before it forks the ranks, no more: with the ``swift sft`` pipeline imported here
    too (2 s more a rank), the forked runs' dataset rows reached the template unconverted (``KeyError: 'messages'``),
    so each run imports it itself, as before."""
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    import swift.pipelines  # noqa: F401

    import distributed_driver  # noqa: F401
    import fork_launch  # noqa: F401
    import swift_dynamic_callbacks.integrations.swift  # noqa: F401


def _run(request: dict) -> int:
    """In the forked child: become the run (its session, environment, directory, output) and run it."""
    os.setsid()
    log = os.open(request['log'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    import distributed_driver
    import fork_launch
    nproc, spec = int(request['nproc']), request['spec']
    if nproc > 1:
        sys.argv = [fork_launch.__file__, str(nproc), str(request['port']), spec]
        return fork_launch.main(nproc, int(request['port']), spec)
    sys.argv = [distributed_driver.__file__, spec]
    try:
        distributed_driver.main(spec)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, and the exit status of the run, as a fresh process's would be
        traceback.print_exc()
        return 1
    return 0


def serve() -> int:
    _preimport()
    print(json.dumps({'ready': True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            raise SystemExit(code)  # a normal interpreter exit (atexit handlers, buffers flushed), as a fresh run's
        print(json.dumps({'pid': pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({'pid': pid, 'code': os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(serve())
