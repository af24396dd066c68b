"""prompt_logprobs: every prompt token's logprob given its prefix, against transformers' forward pass."""

import pytest
import torch

from engine.llm import LLM
from engine.params import SamplingParams


def hf_prompt_logprobs(model_dir: str, ids: list[int], top: int) -> list:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    out = [None]
    for pos in range(1, len(ids)):
        row = logprobs[pos - 1]
        values, indices = row.topk(top)
        out.append((row[ids[pos]].item(), list(zip(indices.tolist(), values.tolist()))))
    return out


def assert_close(got: list, expected: list) -> None:
    assert len(got) == len(expected) and got[0] is None
    for pos, (g, e) in enumerate(zip(got[1:], expected[1:]), start=1):
        assert g[0] == pytest.approx(e[0], abs=1e-4), pos
        assert [t for t, _ in g[1]] == [t for t, _ in e[1]], pos
        assert [lp for _, lp in g[1]] == pytest.approx([lp for _, lp in e[1]], abs=1e-4), pos


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_prompt_logprobs_match_transformers_chunked_and_past_a_prefix_hit(tiny_chat_model, enforce_eager):
    torch.manual_seed(0)
    long = torch.randint(0, 49152, (150,)).tolist()
    short = long[:40] + torch.randint(0, 49152, (5,)).tolist()
    with LLM(
        tiny_chat_model,
        dtype="float32",
        enforce_eager=enforce_eager,
        num_kv_blocks=128,
        max_num_batched_tokens=64,  # the long prompt prefills in three chunks
        enable_prefix_caching=True,
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
        plain = SamplingParams(temperature=0, max_tokens=2)
        first = llm.generate([long], params, use_tqdm=False)[0]
        llm.generate([long], plain, use_tqdm=False)  # cached now
        again, shorter = llm.generate([long, short], params, use_tqdm=False)
        stats = llm.get_stats()
        n2 = llm.generate([short], SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=0))[0]
    assert stats["prefix_cache_hits"] > 0  # the plain request hit; those asking for logprobs computed all
    expected = hf_prompt_logprobs(tiny_chat_model, long, 3)
    assert_close(first.prompt_logprobs, expected)
    assert_close(again.prompt_logprobs, expected)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_close(shorter.prompt_logprobs, hf_prompt_logprobs(tiny_chat_model, short, 3))
    zero = hf_prompt_logprobs(tiny_chat_model, short, 1)
    assert [lp for lp, top in n2.prompt_logprobs[1:]] == pytest.approx([e[0] for e in zero[1:]], abs=1e-4)
    assert all(top == [] for _, top in n2.prompt_logprobs[1:]) and len(n2.outputs) == 2


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_samples_wait_for_the_prompt_logprobs_their_first_output_carries(smollm2_dir):
    """Only sample 0 computes them; a sample that reports first (one whose sample 0 was preempted) is held
    until sample 0 does, so a stream's every choice opens with the prompt's logprobs."""
    from transformers import AutoTokenizer

    from engine.input_processor import InputProcessor
    from engine.messages import EngineCoreOutput
    from engine.output_processor import OutputProcessor

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prepared = InputProcessor(tok, 64, [2], 49152).process(
        "r", [5, 6, 7], SamplingParams(n=2, max_tokens=4, prompt_logprobs=0), 0.0
    )
    processor = OutputProcessor(tok)
    processor.add_request(prepared)
    assert processor.process_outputs([EngineCoreOutput("r#1", [9])]) == ([], [], {})
    prompt_lps = [None, (-1.0, []), (-2.0, [])]
    (out,), _, _ = processor.process_outputs([EngineCoreOutput("r#0", [8], prompt_logprobs=prompt_lps)])
    assert out.prompt_logprobs == prompt_lps
    assert [c.delta_token_ids for c in out.outputs] == [[8], [9]]  # the held token comes along
    (out,), _, _ = processor.process_outputs([EngineCoreOutput("r#1", [10], finish_reason="length")])
    assert [c.delta_token_ids for c in out.outputs] == [[], [10]]
