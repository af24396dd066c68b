import pytest
import torch

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_tiny_model(path, kind: str = "llama") -> str:
    """Save a random-weight model of the given family to `path` (an HF directory)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    elif kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
        model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=True))
    elif kind == "mistral":
        # A window shorter than the tests' prompts: each query attends to its 12 latest keys only.
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=12, tie_word_embeddings=False))
    elif kind == "phi3":  # RoPE over half of each head, as Phi-4-mini's three quarters
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        config = Phi3Config(**TINY, rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = Phi3ForCausalLM(config)
    elif kind == "gemma2":  # a window of 12 on layer 0, caps low enough to bend these scores and logits
        config = Gemma2Config(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=12,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=2.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = Gemma2ForCausalLM(config)
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    # Random init leaves q/k/v biases at zero; make them matter.
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.data.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session", params=["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma2"])
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_dir():
    from server.bench.driver import model_dir

    return model_dir(None)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One live `kiln serve` of the default model for tests/test_server.py and tests/test_responses.py."""
    from tests.test_server import live_server

    with live_server(tmp_path_factory) as live:
        yield live


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2_dir):
    """A random-weight 2-layer Llama with SmolLM2's tokenizer and chat template: fast, real text path."""
    import shutil
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_chat")
    cfg = dict(TINY, vocab_size=49152, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    for f in Path(smollm2_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, path / f.name)
    return str(path)


def children_of(parent: int, marker: str) -> list[int]:
    """The processes whose parent is `parent` and whose command line holds `marker`."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if marker in cmd and ppid == parent:
            found.append(int(proc.name))
    return found


def engine_core_children() -> list[int]:
    """Engine-core processes whose parent is this test process."""
    import os

    return children_of(os.getpid(), "engine.core")


def engine_core_of(pid: int) -> int:
    """The engine-core process whose parent is `pid` (a server)."""
    from server.bench.soak import engine_core_pid

    return engine_core_pid(pid)
