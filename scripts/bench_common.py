"""What the benchmark scripts share: the header lines that say how and where figures were taken."""

from __future__ import annotations

import os
import platform
import shlex


def machine_lines(argv: list[str]) -> list[str]:
    """``Command``, ``Machine`` and ``Versions`` lines (markdown) for a benchmark report."""
    import swift
    import torch
    import transformers

    import swift_dynamic_callbacks as sdc
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'
    cuda = (f' (CUDA available: {torch.cuda.get_device_name(0)}, not used by this run)'
            if torch.cuda.is_available() else '')
    return [
        f'Command: `{" ".join(shlex.quote(a) for a in argv)}`',
        '',
        f'Machine: {platform.platform()}, Python {platform.python_version()}, os.cpu_count()={os.cpu_count()}, '
        f'usable CPUs={cpus}, torch threads={torch.get_num_threads()}, device=cpu{cuda}',
        f'Versions: torch {torch.__version__}, transformers {transformers.__version__}, ms-swift '
        f'{swift.__version__}, swift_dynamic_callbacks {sdc.__version__}',
    ]
