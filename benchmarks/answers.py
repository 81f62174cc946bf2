"""The main job's held-out check: greedy answers of the model to every held-out GSM8K question, before and after the
LoRA fine-tune, scored on one line, and one question shown in full.

Two scores, on every held-out row: how many answers end in GSM8K's answer form (a line ``#### N``: what the
fine-tune teaches first) and how many give the reference's final number. The prompt is the ChatML turn ms-swift's
``chatml`` template trains on (no system prompt); decoding is greedy, batched, with ``no_repeat_ngram_size`` (a
135M model's greedy decoding otherwise tends to loop on arithmetic such as ``16 x 16 = ...``; the setting only
forbids repeating the same n words verbatim, it hides no output).

Usage (what ``scripts/main_job.sh`` runs):
    python scripts/main_job_answer.py --model .cache/main_job/smollm2-135m-instruct \
        --adapter output/main_job/checkpoint-N --data .cache/main_job/gsm8k-test.jsonl --index 0
"""

from __future__ import annotations

import argparse
import json
import re
import sys

ANSWER = re.compile(r'####\s*\$?\s*(-?[\d,]*\.?\d+)')


def chatml_prompt(question: str) -> str:
    """The user turn and the opened assistant turn, as ms-swift's ``chatml`` template writes them."""
    return f'<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n'


def final_number(text: str) -> str | None:
    """The number after the last ``####`` of an answer (commas dropped), or ``None`` when it has no such line."""
    found = ANSWER.findall(text)
    return found[-1].replace(',', '').rstrip('.') if found else None


def score(answers: list[str], references: list[str]) -> tuple[int, int]:
    """``(answers in the '#### N' form, answers whose final number is the reference's)``."""
    numbers = [final_number(a) for a in answers]
    wanted = [final_number(r) for r in references]
    formed = sum(n is not None for n in numbers)
    correct = sum(n is not None and w is not None and float(n) == float(w) for n, w in zip(numbers, wanted))
    return formed, correct


def read_rows(path: str) -> tuple[list[str], list[str]]:
    """``(questions, reference answers)`` of the held-out rows in messages form (JSONL) at ``path``."""
    with open(path, encoding='utf-8') as f:
        rows = [json.loads(line) for line in f if line.strip()]
    questions = [next(m['content'] for m in r['messages'] if m['role'] == 'user') for r in rows]
    references = [next(m['content'] for m in r['messages'] if m['role'] == 'assistant') for r in rows]
    return questions, references


def greedy(model, tokenizer, questions: list[str], max_new_tokens: int, no_repeat: int) -> list[str]:
    import torch
    tokenizer.padding_side = 'left'
    batch = tokenizer([chatml_prompt(q) for q in questions], return_tensors='pt', padding=True,
                      add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             no_repeat_ngram_size=no_repeat or 0,
                             eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'),
                             pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row[batch['input_ids'].shape[1]:], skip_special_tokens=True).strip() for row in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True, help='the base model folder')
    parser.add_argument('--adapter', required=True, help='the LoRA checkpoint of the run')
    parser.add_argument('--data', required=True, help='held-out rows in messages form (JSONL)')
    parser.add_argument('--index', type=int, default=0, help='which row of --data to show in full')
    parser.add_argument('--max-new-tokens', type=int, default=200)
    parser.add_argument('--no-repeat-ngram', type=int, default=6,
                        help='greedy decoding never repeats the same n tokens verbatim (0: off)')
    args = parser.parse_args(argv)
    questions, references = read_rows(args.data)
    if not 0 <= args.index < len(questions):
        parser.error(f'--index: between 0 and {len(questions) - 1} for {args.data}, got {args.index}')

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    before = greedy(model, tokenizer, questions, args.max_new_tokens, args.no_repeat_ngram)
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    after = greedy(model, tokenizer, questions, args.max_new_tokens, args.no_repeat_ngram)
    (formed_0, correct_0), (formed_1, correct_1) = score(before, references), score(after, references)
    n = len(questions)
    print(f'held-out GSM8K rows ({n}), greedy: answers in the "#### N" form {formed_0}/{n} -> {formed_1}/{n}; '
          f'correct final number {correct_0}/{n} -> {correct_1}/{n}\n')
    i = args.index
    print(f'held-out question ({args.data} row {i}):\n  {questions[i]}\n')
    print(f'reference answer: {final_number(references[i])}\n')
    print(f'before fine-tuning (greedy):\n  {before[i].replace(chr(10), chr(10) + "  ")}\n')
    print(f'after fine-tuning (greedy):\n  {after[i].replace(chr(10), chr(10) + "  ")}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
