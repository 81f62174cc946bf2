"""A plain ``transformers.Trainer`` (no ms-swift trainer): ``install()`` makes the flags work; without it, a warning."""

from __future__ import annotations

import json
import os

import pytest
import torch

import swift_dynamic_callbacks as sdc
from swift_dynamic_callbacks import protocol
from swift_runs import indices_by_epoch, read_jsonl, sample_trace

pytestmark = pytest.mark.e2e


class _Rows(torch.utils.data.Dataset):

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _collate(pad_id):

    def collate(items):
        width = max(len(x['input_ids']) for x in items)
        ids = torch.full((len(items), width), pad_id)
        labels = torch.full((len(items), width), -100)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for r, x in enumerate(items):
            n = len(x['input_ids'])
            ids[r, :n] = torch.tensor(x['input_ids'])
            labels[r, :n] = torch.tensor(x['input_ids'])
            mask[r, :n] = 1
        return {'input_ids': ids, 'labels': labels, 'attention_mask': mask}

    return collate


@pytest.fixture(autouse=True)
def _plain_hf_defaults(monkeypatch):
    """Importing ms-swift swaps HF's default callbacks for its own globally; a plain Trainer gets HF's back."""
    import transformers.trainer as hf_trainer
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback
    monkeypatch.setattr(hf_trainer, 'DEFAULT_CALLBACKS', [DefaultFlowCallback])
    monkeypatch.setattr(hf_trainer, 'DEFAULT_PROGRESS_CALLBACK', ProgressCallback)
    monkeypatch.setattr(hf_trainer, 'PrinterCallback', PrinterCallback)


def _trainer(tiny_llama, gsm8k_16, output_dir, callbacks, **args):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rows = []
    for line in open(gsm8k_16, encoding='utf-8'):
        messages = json.loads(line)['messages']
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        rows.append({'input_ids': encoded['input_ids']})
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(r=4, target_modules=['q_proj', 'v_proj']))
    targs = TrainingArguments(
        output_dir=output_dir,
        **{'per_device_train_batch_size': 2, 'gradient_accumulation_steps': 1, **args},
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy='no',
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=_Rows(rows),
                      data_collator=_collate(tokenizer.pad_token_id))
    for cb in callbacks:
        trainer.add_callback(cb)
    return trainer


def test_plain_trainer_with_install(tmp_path, tiny_llama, gsm8k_16):
    callback = sdc.BatchScheduleCallback(sdc.BatchScheduleConfig(schedule={0: 2, 2: 3, 5: 1}))
    trainer = _trainer(tiny_llama, gsm8k_16, str(tmp_path / 'hf'), [callback], num_train_epochs=1)
    sdc.install(trainer, sdc.IntegrationConfig(record_samples=True))
    trainer.train()
    trace = sample_trace(str(tmp_path / 'hf'))
    assert sorted(indices_by_epoch(trace)[0]) == list(range(16)) and set(indices_by_epoch(trace)) == {0}
    assert [row['batch_size'] for row in trace] == [2, 2, 3, 3, 3, 1, 1, 1]
    logged = [row for row in trainer.state.log_history if 'loss' in row]
    assert [row['dynamic/batch_size'] for row in logged] == [2, 2, 3, 3, 3, 1, 1, 1]
    records = read_jsonl(os.path.join(str(tmp_path / 'hf'), 'dynamic_decisions.jsonl'))
    assert [(r['step'], r['values']['new']) for r in records if r['kind'] == 'batch_size'] == [(2, 3), (5, 1)]


def test_flags_without_integration_warn_once(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    monkeypatch.setattr(protocol.requests, '_warned_unhonoured', False)
    callback = sdc.BatchScheduleCallback(sdc.BatchScheduleConfig(schedule={0: 2, 1: 4}))
    trainer = _trainer(tiny_llama, gsm8k_16, str(tmp_path / 'hf'), [callback], max_steps=3)
    with pytest.warns(RuntimeWarning, match='not honoured') as caught:
        trainer.train()
    assert sum('not honoured' in str(w.message) for w in caught) == 1


def _token_losses(outputs, labels):
    logits = outputs.logits[:, :-1].float()
    targets = labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100, reduction='none'), (targets != -100).sum()


def test_a_python_loss_function_under_pass_tokens_is_refused_unless_declared(tmp_path, tiny_llama, gsm8k_16):
    """HF's ``compute_loss_func`` set in Python: passes cut by tokens keep the gradient only under a token-sum loss,
    which the pack cannot see in a function; a per-pass mean is refused at train start, a declared sum runs."""
    def mean_loss(outputs, labels, num_items_in_batch=None):
        losses, tokens = _token_losses(outputs, labels)
        return losses.sum() / tokens

    calls = []

    @sdc.mark_token_sum_loss
    def sum_loss(outputs, labels, num_items_in_batch=None):
        calls.append(num_items_in_batch)
        return _token_losses(outputs, labels)[0].sum() / num_items_in_batch

    def run(loss_func, name):
        callback = sdc.LengthBatchingCallback(sdc.LengthBatchingConfig(mode='balanced', pass_tokens=1200))
        trainer = _trainer(tiny_llama, gsm8k_16, str(tmp_path / name), [callback], max_steps=2,
                           gradient_accumulation_steps=2)
        trainer.compute_loss_func = loss_func
        sdc.install(trainer)
        trainer.train()
        return trainer

    with pytest.raises(sdc.ConfigError, match='compute_loss_func: .*mean_loss cannot be combined with '
                                              'dynamic_callbacks.length_batching.pass_tokens'):
        run(mean_loss, 'mean')
    trainer = run(sum_loss, 'sum')
    assert trainer.state.global_step == 2
    assert calls and all(n is not None for n in calls)
