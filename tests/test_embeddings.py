"""Embeddings: a pooling request is a prefill with nothing sampled, batched with generation, checked
against transformers' final hidden states (float32)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.params import PoolingParams, SamplingParams

PROMPTS = [[1, 5, 9, 200, 17], [3, *range(40, 90)], [7, 7, 7, 8, 2, 11, 300, 4, 4, 19, 20, 21, 22, 23]]
ENGINE = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=40, block_size=16, enforce_eager=True)


def hf_embeddings(model_dir: str, pooling: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    out = []
    for ids in PROMPTS:
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        v = hidden[-1] if pooling == "last" else hidden.mean(0)
        out.append(torch.nn.functional.normalize(v, dim=0))
    return out


@pytest.mark.parametrize(
    "pooling, args",
    [("last", {}), ("mean", dict(max_num_batched_tokens=16))],  # mean over chunks of several steps
    ids=["last", "mean-chunked"],
)
def test_embeddings_equal_transformers_pooled_hidden_states(tiny_chat_model, pooling, args):
    expected = hf_embeddings(tiny_chat_model, pooling)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_chat_model, pooling=pooling, **ENGINE, **args) as llm:
        alone = llm.generate(PROMPTS, greedy, use_tqdm=False)
        got = [torch.tensor(o.outputs.embedding) for o in llm.embed(PROMPTS, use_tqdm=False)]
        again = llm.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding  # a prefix-cache hit, for last
        # Embedding and generating requests in the same steps: neither changes the other.
        mixed = llm.generate(PROMPTS * 2, [greedy] * 3 + [llm.embedding_params()] * 3, use_tqdm=False)
        raw = llm.embed(PROMPTS[:1], normalize=False, use_tqdm=False)[0].outputs.embedding
        stats = llm.get_stats()
    for g, e in zip(got, expected):
        assert g.shape == e.shape and torch.allclose(g, e, atol=1e-4), (g - e).abs().max()
    assert torch.allclose(torch.tensor(again), got[0], atol=1e-5)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    for o, g in zip(mixed[3:], got):
        assert (
            o.finished
            and o.outputs[0].token_ids == []
            and torch.allclose(torch.tensor(o.embedding), g, atol=1e-5)
        )
    raw = torch.tensor(raw)
    assert abs(raw.norm() - 1) > 1e-3 and torch.allclose(raw / raw.norm(), got[0], atol=1e-5)
    assert stats["kv_cache_usage"] == 0.0
    # The mixed run's prompts were all cached by then: mean pooling, which must compute every position,
    # matched only because it takes no hit.
    assert stats["prefix_cache_hits"] > 0


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams(pooling="max")
    with pytest.raises(ValueError, match="pooling needs n = 1"):
        SamplingParams(n=2, max_tokens=1, pooling=PoolingParams())
