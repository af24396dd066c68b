"""Model families beyond Llama's own names (Phi-3: fused weights, RoPE over part of each head; Gemma 2:
its norms, GELU, scaled embeddings, soft-capped scores and logits, local and global layers), against
transformers in float32: greedy tokens compiled (fresh prompts tiled together, chunks after context,
decodes past the local window) and on two tensor-parallel ranks with prefix-cache hits. Every family's
packed step (chunks, decodes, a prefix-cache hit) is checked in tests/test_model_runner.py."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from compiled.loader import load_config
from compiled.models.family import family_of
from compiled.models.llama import ModelArgs
from engine.llm import LLM
from engine.params import SamplingParams
from server.bench.driver import build_runner, greedy_mismatches, hf_greedy
from tests.conftest import make_tiny_model
from tests.test_model_runner import hf_model, poison_kv_cache


@pytest.fixture(scope="module", params=["phi3", "gemma2"])
def family(request, tmp_path_factory, smollm2_dir) -> str:
    path = Path(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))
    for f in Path(smollm2_dir).iterdir():  # a tokenizer for the engine's front end
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return str(path)


def test_a_kept_config_reads_as_transformers_resolves_it(tiny_model, tmp_path, monkeypatch):
    """Every family's config, resolved through transformers at the first start and read back from the
    cache at later ones, gives the model transformers' own config object gives."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    expected = AutoConfig.from_pretrained(tiny_model)
    resolved = load_config(tiny_model)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "transformers", None)  # any import of it fails
        kept = load_config(tiny_model)
    assert len(list((tmp_path / "configs").iterdir())) == 1
    assert resolved.model_type == kept.model_type == expected.model_type
    assert ModelArgs.from_hf_config(resolved) == ModelArgs.from_hf_config(kept)
    assert ModelArgs.from_hf_config(kept) == ModelArgs.from_hf_config(expected)


def test_configs_are_read_as_their_families(family):
    config = load_config(family)
    assert family_of(config).model_types == (config.model_type,)
    args = ModelArgs.from_hf_config(config)
    if config.model_type == "phi3":
        assert (args.head_dim, args.rope_dim) == (16, 8)
    else:  # Gemma 2: the first layer local, the second global
        assert args.windows == (12, 0) and (args.attn_softcap, args.logit_softcap) == (1.5, 2.0)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; kiln runs gemma2, llama, mistral"):
        family_of(type("Config", (), {"model_type": "gpt2"}))


def test_compiled_greedy_matches_transformers(family):
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    runner = build_runner(family, dtype="float32", max_num_seqs=4, num_kv_blocks=64, block_size=16)
    runner.initialize_kv_cache(64)
    runner.warmup()
    poison_kv_cache(runner)
    torch.manual_seed(4)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (45, 9, 30, 17)]
    with torch._dynamo.config.patch(error_on_recompile=True):  # every graph of every kind of layer is warm
        mismatches = greedy_mismatches(runner, hf_model(family), prompts, 24, tail_tokens=40, chunk=20)
    assert mismatches == []
    # Gemma's local and global layers run graphs of their own (guard-free, each verified).
    kinds = {len({id(g) for g in layers.graphs.values()}) for layers in runner.policy.decode_graphs.values()}
    assert kinds == ({2} if "gemma2" in family else {1})


def test_two_ranks_match_transformers(family):
    torch.manual_seed(5)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (37, 6, 21)]
    prompts.append([*prompts[0][:20], 7, 8, 9])  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=32)
    with LLM(family, tensor_parallel_size=2, enforce_eager=True, block_size=16, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats()["prefix_cache_hits"] > 0
    hf = hf_model(family)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in prompts]
