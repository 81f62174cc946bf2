"""Start-up overhead of ``swift-dynamic sft`` over ``swift sft``: the time from process start to ms-swift's own start.

What is timed, for both commands on the same YAML (``configs/main_job.yaml`` by default; ``swift sft`` gets the file
without its ``dynamic_callbacks:`` section, which it would reject):

- ``swift sft FILE`` runs ms-swift's command line (``swift.cli.main.cli_main``: Python start, ``import swift...``,
  reading the YAML), which prints ``run sh: `python .../swift/cli/sft.py ...``` and then starts the training process;
- ``swift-dynamic sft FILE`` first runs the pack's launcher (Python start, reading and validating the YAML with the
  torch-free ``config`` package, writing the launch file) and then exactly the same ms-swift command line.

The clock starts when the process is started and stops when ``run sh:`` appears on its output: from there on both runs
do the same thing (load torch, the model, the data, train). The process group is then killed, so nothing trains and
no model is needed (the model path in the YAML is never opened). ``swift sft`` is run as ``python -c 'from
swift.cli.main import cli_main; cli_main()'`` (what the ``swift`` script does) and ``swift-dynamic`` as ``python -m
swift_dynamic_callbacks.cli``, with the same interpreter. The overhead is the difference of the medians; the
launcher's validation alone (``swift-dynamic check``) is timed as well.

    python scripts/bench_cli.py [--config configs/main_job.yaml] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWIFT = [sys.executable, '-c', 'from swift.cli.main import cli_main; cli_main()']
DYNAMIC = [sys.executable, '-m', 'swift_dynamic_callbacks.cli']
MARK = 'run sh:'


def time_to_swift_start(cmd: list[str], env: dict[str, str], timeout: float = 120.0) -> float:
    """Seconds from starting ``cmd`` until ms-swift prints ``run sh:`` (then the whole process group is killed)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if MARK in line:
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                break
        raise RuntimeError(f'{" ".join(cmd[:4])}: no {MARK!r} line; output:\n{"".join(seen)[-3000:]}')
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def time_run(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f'{" ".join(cmd)} failed:\n{result.stderr[-3000:]}')
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--config', default=os.path.join(ROOT, 'configs', 'main_job.yaml'))
    parser.add_argument('--rounds', type=int, default=7)
    opts = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get('PYTHONPATH')) if p))
    with open(opts.config, encoding='utf-8') as f:
        config = yaml.safe_load(f)
    config.pop('dynamic_callbacks', None)
    plain = os.path.join(tempfile.mkdtemp(prefix='bench-cli-'), os.path.basename(opts.config))
    with open(plain, 'w', encoding='utf-8') as f:
        yaml.safe_dump(config, f, sort_keys=False)
    time_to_swift_start(SWIFT + ['sft', plain], env)  # warm the file cache once for both
    time_to_swift_start(DYNAMIC + ['sft', opts.config], env)
    swift, dynamic, check = [], [], []
    for _ in range(opts.rounds):  # alternate, so drifting load on the machine hits both alike
        swift.append(time_to_swift_start(SWIFT + ['sft', plain], env))
        dynamic.append(time_to_swift_start(DYNAMIC + ['sft', opts.config], env))
        check.append(time_run(DYNAMIC + ['check', opts.config], env))
    med = {name: statistics.median(values) for name, values in
           (('swift sft', swift), ('swift-dynamic sft', dynamic), ('swift-dynamic check', check))}
    print(f'config: {os.path.relpath(opts.config, ROOT)}, {opts.rounds} rounds, python {sys.version.split()[0]}')
    print('| command | time to ms-swift\'s start (median, s) | min | max |')
    print('|---|---:|---:|---:|')
    for name, values in (('swift sft', swift), ('swift-dynamic sft', dynamic)):
        print(f'| `{name}` | {med[name]:.3f} | {min(values):.3f} | {max(values):.3f} |')
    print(f'| `swift-dynamic check` (whole command, for reference) | {med["swift-dynamic check"]:.3f} | '
          f'{min(check):.3f} | {max(check):.3f} |')
    print(f'overhead of swift-dynamic sft: {med["swift-dynamic sft"] - med["swift sft"]:+.3f} s (goal <= 1 s)')


if __name__ == '__main__':
    main()
