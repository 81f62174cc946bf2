"""Greedy answer of the main job's model to one held-out GSM8K question, before and after the LoRA fine-tune.

The prompt is the ChatML turn ms-swift's ``chatml`` template trains on (no system prompt); decoding is greedy.

Usage (what ``scripts/main_job.sh`` runs):
    python scripts/main_job_answer.py --model .cache/demo/smollm2-135m-instruct \
        --adapter output/main_job/checkpoint-N --data .cache/demo/gsm8k-test.jsonl --index 0
"""

from __future__ import annotations

import argparse
import json
import sys


def chatml_prompt(question: str) -> str:
    """The user turn and the opened assistant turn, as ms-swift's ``chatml`` template writes them."""
    return f'<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n'


def greedy(model, tokenizer, question: str, max_new_tokens: int) -> str:
    import torch
    ids = tokenizer(chatml_prompt(question), return_tensors='pt', add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'),
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True, help='the base model folder')
    parser.add_argument('--adapter', required=True, help='the LoRA checkpoint of the run')
    parser.add_argument('--data', required=True, help='held-out rows in messages form (JSONL)')
    parser.add_argument('--index', type=int, default=0, help='which row of --data')
    parser.add_argument('--max-new-tokens', type=int, default=160)
    args = parser.parse_args(argv)
    with open(args.data, encoding='utf-8') as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not 0 <= args.index < len(rows):
        parser.error(f'--index: between 0 and {len(rows) - 1} for {args.data}, got {args.index}')
    messages = rows[args.index]['messages']
    question = next(m['content'] for m in messages if m['role'] == 'user')
    reference = next(m['content'] for m in messages if m['role'] == 'assistant')

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    before = greedy(model, tokenizer, question, args.max_new_tokens)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    after = greedy(model, tokenizer, question, args.max_new_tokens)
    final = reference.split('####')[-1].strip()
    print(f'held-out question ({args.data} row {args.index}):\n  {question}\n')
    print(f'reference answer: {final}\n')
    print(f'before fine-tuning (greedy):\n  {before.replace(chr(10), chr(10) + "  ")}\n')
    print(f'after fine-tuning (greedy):\n  {after.replace(chr(10), chr(10) + "  ")}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
