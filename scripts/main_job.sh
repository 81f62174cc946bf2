#!/usr/bin/env bash
# The main job: a real LoRA fine-tune with the pack on the embedded tiny Qwen2.5 model and GSM8K slice.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/setup_env.sh
"$VENV/bin/swift-dynamic" prepare-demo .cache/demo --rows 128
rm -rf output/main_job
"$VENV/bin/swift-dynamic" sft configs/main_job.yaml
out=output/main_job
"$VENV/bin/swift-dynamic" report "$out"
echo
echo "Main job finished. Outputs in $out/:"
echo "  training log        $out/logging.jsonl   (loss, learning_rate, dynamic/batch_size, dynamic/samples_seen ...)"
echo "  decisions           $out/dynamic_decisions.jsonl"
echo "  report              $out/dynamic_report.md   (decision table) and $out/dynamic_report.png (plots)"
echo "  sample audit trail  $out/dynamic_samples.rank0.jsonl"
echo "  TensorBoard         $out/runs"
echo "  checkpoints         $(ls -d $out/checkpoint-* | tr '\n' ' ')"
