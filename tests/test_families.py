"""Model families beyond Llama's own names, against transformers in float32: greedy tokens compiled
(fresh prompts tiled together, chunks after context, decodes) and on two tensor-parallel ranks with
prefix-cache hits. Every family's packed step (chunks, decodes, a prefix-cache hit) is checked in
tests/test_model_runner.py."""

import shutil
from pathlib import Path

import pytest
import torch

from compiled.loader import load_config
from compiled.models.family import family_of
from compiled.models.llama import ModelArgs
from engine.llm import LLM
from engine.params import SamplingParams
from server.bench.driver import build_runner, greedy_mismatches, hf_greedy
from tests.conftest import make_tiny_model
from tests.test_model_runner import hf_model, poison_kv_cache


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, smollm2_dir) -> str:
    path = Path(make_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3"))
    for f in Path(smollm2_dir).iterdir():  # a tokenizer for the engine's front end
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return str(path)


def test_phi3_is_read_through_its_own_names(phi3):
    config = load_config(phi3)
    assert family_of(config).model_types == ("phi3",)
    args = ModelArgs.from_hf_config(config)
    assert (args.head_dim, args.rope_dim) == (16, 8)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; kiln runs llama, mistral, phi3"):
        family_of(type("Config", (), {"model_type": "gpt2"}))


def test_phi3_compiled_greedy_matches_transformers(phi3):
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    runner = build_runner(phi3, dtype="float32", max_num_seqs=4, num_kv_blocks=64, block_size=16)
    runner.initialize_kv_cache(64)
    poison_kv_cache(runner)
    torch.manual_seed(4)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (45, 9, 30, 17)]
    assert greedy_mismatches(runner, hf_model(phi3), prompts, batch_tokens=24, tail_tokens=40, chunk=20) == []


def test_phi3_on_two_ranks_matches_transformers(phi3):
    torch.manual_seed(5)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (37, 6, 21)]
    prompts.append([*prompts[0][:20], 7, 8, 9])  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=32)
    with LLM(phi3, tensor_parallel_size=2, enforce_eager=True, block_size=16, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats()["prefix_cache_hits"] > 0
    hf = hf_model(phi3)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in prompts]
