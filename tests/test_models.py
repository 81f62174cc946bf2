"""What a model is, decided from its config before it loads (``config/models.py``): the layout of its micro-batches
(text, Qwen-VL, another multimodal layout), linear attention, MoE. ``swift-dynamic check`` reads a local model folder's
``config.json`` (no weights, no torch) and refuses there what the run could not honour; the input kinds at train start
apply the same rule to the loaded config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from swift_dynamic_callbacks.config.models import (VisionShape, layout_of, linear_attention_of, model_facts, moe_of,
                                                   vision_shape_of)


def _configs():
    import transformers as T
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig
    return {'qwen2_vl': T.Qwen2VLConfig(), 'qwen2_5_vl': T.Qwen2_5_VLConfig(), 'qwen3_vl': T.Qwen3VLConfig(),
            'qwen3_vl_moe': T.Qwen3VLMoeConfig(), 'qwen3_5': Qwen3_5Config(), 'qwen3_5_moe': Qwen3_5MoeConfig(),
            'qwen2': T.Qwen2Config(), 'llama': T.LlamaConfig(), 'qwen3_next': T.Qwen3NextConfig(),
            'llava': T.LlavaConfig(), 'glm4v': T.Glm4vConfig(), 'qwen2_5_omni': T.Qwen2_5OmniConfig(),
            'internvl': T.InternVLConfig()}


def test_the_layout_of_every_family_from_its_config():
    """Read from the config's structure, as a ``config.json`` mapping and as the loaded config alike."""
    expected = {'qwen2_vl': 'qwen_vl', 'qwen2_5_vl': 'qwen_vl', 'qwen3_vl': 'qwen_vl', 'qwen3_vl_moe': 'qwen_vl',
                'qwen3_5': 'qwen_vl', 'qwen3_5_moe': 'qwen_vl', 'qwen2': 'text', 'llama': 'text', 'qwen3_next': 'text',
                'llava': 'multimodal', 'glm4v': 'multimodal', 'qwen2_5_omni': 'multimodal', 'internvl': 'tiles'}
    for name, config in _configs().items():
        assert (layout_of(config), layout_of(config.to_dict())) == (expected[name],) * 2, name
    configs = _configs()
    assert linear_attention_of(configs['qwen3_5']) and linear_attention_of(configs['qwen3_5'].to_dict())
    assert linear_attention_of(configs['qwen3_next']) and not linear_attention_of(configs['qwen3_vl'])
    assert moe_of(configs['qwen3_5_moe'].to_dict()) and moe_of(configs['qwen3_vl_moe'])
    assert not moe_of(configs['qwen3_5'].to_dict()) and not moe_of(configs['qwen2'])


def test_the_vision_towers_shape_from_its_config():
    """Each Qwen-VL family names its tower's widths its own way (Qwen2-VL: ``embed_dim`` and ``mlp_ratio``, its
    ``hidden_size`` the language model's); read from the loaded config and from ``config.json`` alike."""
    import transformers as T
    qwen2_vl = T.Qwen2VLConfig(vision_config=dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4,
                                                  hidden_act='quick_gelu', spatial_merge_size=2))
    qwen2_5_vl = T.Qwen2_5_VLConfig(vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420,
                                                       hidden_act='silu', out_hidden_size=3584))
    configs = _configs()
    expected = {'qwen2_vl': (qwen2_vl, VisionShape(1280, 5120, 32, False, 4)),
                'qwen2_5_vl': (qwen2_5_vl, VisionShape(1280, 3420, 32, True, 4)),
                'qwen3_5': (configs['qwen3_5'], VisionShape(1152, 4304, 27, False, 4)),
                'qwen3_vl': (configs['qwen3_vl'], VisionShape(1152, 4304, 27, False, 4)),
                'internvl': (configs['internvl'], VisionShape(1024, 4096, 24, False, 4))}  # InternViT-300M
    for name, (config, shape) in expected.items():
        assert vision_shape_of(config) == vision_shape_of(config.to_dict()) == shape, name
    for name in ('qwen2', 'llava', 'glm4v'):  # text, or a layout the cost model does not know
        assert vision_shape_of(configs[name]) is None, name


def _folder(tmp_path, name, config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps(config.to_dict() if hasattr(config, 'to_dict') else config),
                                        encoding='utf-8')
    return str(folder)


def test_a_model_folder_is_read_before_it_loads(tmp_path):
    """A local folder's ``config.json``: a Qwen family model type the pack never listed is the Qwen-VL layout; a hub id
    falls back to the names."""
    config = _configs()['qwen3_5'].to_dict()
    config['model_type'] = 'qwen3_9'  # a Qwen of tomorrow with today's layout
    facts = model_facts({'model': _folder(tmp_path, 'q', config)})
    assert facts.from_config and facts.qwen_vl and facts.linear_attention and facts.moe is False
    assert facts.model_type == 'qwen3_9' and 'config.json' in facts.setting
    assert model_facts({'model': 'Qwen/Qwen3.5-9B'}).qwen_vl  # no folder: the hub id
    assert model_facts({'model': 'x/y', 'model_type': 'qwen2_5_vl'}).qwen_vl
    assert model_facts({'model': 'Qwen/Qwen2.5-7B-Instruct'}).layout is None


def _check(tmp_path, model, callbacks, section, **settings):
    """``swift-dynamic check`` in a fresh process: its exit code and stderr, and whether it imported torch."""
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump({'model': model, 'tuner_type': 'lora', 'dataset': ['d.jsonl'],
                                    'callbacks': callbacks, 'dynamic_callbacks': section, **settings}),
                    encoding='utf-8')
    code = ('import sys\nfrom swift_dynamic_callbacks.cli import main\nrc = main(["check", sys.argv[1]])\n'
            'print("TORCH", "torch" in sys.modules)\nsys.exit(rc)')
    result = subprocess.run([sys.executable, '-c', code, str(path)], capture_output=True, text=True, timeout=120)
    return result.returncode, result.stderr, 'TORCH True' in result.stdout


@pytest.mark.parametrize('name,section,words', [
    ('qwen3_5', {'length_batching': {'padding_free': True, 'micro_batch_tokens': 4096}},
     'length_batching.padding_free: true is not supported with model: '),
    ('llava', {'batch_growth': {'micro_batch_cap': 2, 'maximum': 4}}, 'no input kind of the pack cuts'),
    ('qwen3_5_moe', {'batch_growth': {'micro_batch_cap': 2, 'maximum': 4}, 'router_aux_loss_coef': 0.01},
     'router_aux_loss_coef: 0.01 cannot be combined'),
], ids=['qwen3_5_padding_free', 'llava_split', 'moe_balancing_split'])
def test_check_refuses_from_the_config_without_loading_anything(tmp_path, name, section, words):
    section = dict(section)
    coef = section.pop('router_aux_loss_coef', None)
    extra = {'router_aux_loss_coef': coef} if coef is not None else {}
    folder = _folder(tmp_path, name, _configs()[name])
    rc, err, torch = _check(tmp_path, folder, [k for k in section], section, **extra)
    assert rc == 2 and words in err, err
    assert not torch


def test_a_dense_model_with_a_balancing_coefficient_is_not_refused(tmp_path):
    """``router_aux_loss_coef`` on a dense model (its config has no experts) adds no balancing loss: a split is
    allowed (at f3c4471 the launch refused it whatever the model, while the start accepted it)."""
    folder = _folder(tmp_path, 'dense', _configs()['qwen2'])
    rc, err, torch = _check(tmp_path, folder, ['batch_growth'], {'batch_growth': {'micro_batch_cap': 2, 'maximum': 4}},
                            router_aux_loss_coef=0.01)
    assert rc == 0, err
    assert not torch
