"""What the benchmark scripts share: the header lines that say how and where figures were taken."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import platform
import shlex
from pathlib import Path


def free_port() -> int:
    """A TCP port free now on this host (a rendezvous port for a launched process)."""
    import socket
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def machine_lines(argv: list[str], device: str = 'cpu') -> list[str]:
    """``Command``, ``Machine`` and ``Versions`` lines (markdown) for a benchmark report (``device``: what the run
    trains on)."""
    import swift
    import torch
    import transformers

    import swift_dynamic_callbacks as sdc
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'
    cuda = ''
    if torch.cuda.is_available():
        used = 'used by this run' if device == 'cuda' else 'not used by this run'
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        cuda = f' (CUDA: {torch.cuda.get_device_name(0)}, {gib:.0f} GiB, CUDA {torch.version.cuda}; {used})'
    return [
        f'Command: `{" ".join(shlex.quote(a) for a in argv)}`',
        '',
        f'Machine: {platform.platform()}, Python {platform.python_version()}, os.cpu_count()={os.cpu_count()}, '
        f'usable CPUs={cpus}, torch threads={torch.get_num_threads()}, device={device}{cuda}',
        f'Versions: torch {torch.__version__}, transformers {transformers.__version__}, ms-swift '
        f'{swift.__version__}, swift_dynamic_callbacks {sdc.__version__}',
    ]


def base_parser(doc: str, repo: Path, work_dir_name: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--work-dir`` (under ``<repo>/.cache``), ``--seed``, ``--json``,
    ``--verbose``; each script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--work-dir', default=str(repo / '.cache' / work_dir_name),
                        help=f'model, data and run outputs (default: <repo>/.cache/{work_dir_name}, git-ignored)')
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--json', default=None, help='also write all raw numbers to this JSON file')
    parser.add_argument('--verbose', dest='quiet', action='store_false',
                        help='show the ms-swift / HF output of every run (hidden by default)')
    return parser


@contextlib.contextmanager
def quiet_run(quiet: bool):
    """Around one in-process training: its stdout, stderr and INFO logging hidden when ``quiet``, and printed (the
    last 20,000 characters) if it fails."""
    log = io.StringIO()
    try:
        with contextlib.ExitStack() as stack:
            if quiet:
                stack.enter_context(contextlib.redirect_stdout(log))
                stack.enter_context(contextlib.redirect_stderr(log))
                logging.disable(logging.INFO)
                stack.callback(logging.disable, logging.NOTSET)
            yield
    except BaseException:
        sys.stderr.write(log.getvalue()[-20000:])
        raise
