"""The project's benchmarks and studies, as an importable, tested package (not installed with the pack).

Each module is one benchmark or study with a ``main(argv)``; ``scripts/`` keeps a thin entry point for each
(``python scripts/bench_quality.py ...`` runs :func:`benchmarks.quality.main`), and the shell drivers
(``scripts/growth_study.sh``, ``scripts/lr_study.sh``, ``scripts/gpu_throughput.sh``) call those. Runs go through
the pack's public in-process API (:mod:`swift_dynamic_callbacks.run`) and time steps with its one step timer
(:class:`swift_dynamic_callbacks.testing.timing.StepTimer`).

- :mod:`.common`: options every benchmark takes, machine lines, quiet runs;
- studies: :mod:`.quality` (issue 30), :mod:`.growth_study` (issue 39) with :mod:`.growth_clock`, :mod:`.lr_study`
  (issue 49); :mod:`.study` holds what they share (run claims between streams, result lines, LR ladders, paired
  intervals and futility looks);
- throughput: :mod:`.throughput` (+ its child process :mod:`.throughput_child`), :mod:`.length`,
  :mod:`.packed_proof`; memory: :mod:`.oom`, :mod:`.memory_end`, :mod:`.gpu_oom_demo`; cost: :mod:`.overhead`,
  :mod:`.engines`, :mod:`.resume`, :mod:`.scale`, :mod:`.cli_start`; :mod:`.growth` (growth's mechanics on CPU),
  :mod:`.plot_lr_schedule`, :mod:`.answers` (the main job's greedy answers).
"""
