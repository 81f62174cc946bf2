"""The pack's OOM injector (``testing/faults.py``) acts at the first decoder layer of the language model, whatever
that layer's kind: Qwen3.5's first layer is a Gated DeltaNet linear-attention one (at f3c4471 the injector looked for
``self_attn.layer_idx == 0`` and never fired there)."""

from __future__ import annotations

import pytest
import torch

from swift_dynamic_callbacks.testing.faults import OomInjector, decoder_layer_index


def _tiny_qwen3_5():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    config = Qwen3_5TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               layer_types=['linear_attention', 'full_attention'], linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3_5ForCausalLM(config).train()


def test_the_first_layer_of_any_kind_is_found():
    model = _tiny_qwen3_5()
    layers = model.model.layers
    assert hasattr(layers[0], 'linear_attn') and not hasattr(layers[0], 'self_attn')
    assert [decoder_layer_index(layer) for layer in layers] == [0, 1]
    assert decoder_layer_index(torch.nn.Linear(2, 2)) is None


def test_an_oom_is_injected_at_a_linear_attention_first_layer():
    model = _tiny_qwen3_5()
    ids = torch.randint(0, 128, (2, 6))
    with OomInjector(forward_passes=(1, )) as injector:
        model(input_ids=ids, labels=ids).loss.backward()  # pass 0 runs
        with pytest.raises(torch.OutOfMemoryError):
            model(input_ids=ids, labels=ids)
    assert injector.counts['forward'] == 1 and [rows for rows, _ in injector.passes] == [2, 2]
