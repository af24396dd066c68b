"""Tensor parallelism on CPU (gloo): worker processes per rank, the same greedy tokens and prompt logits
as one process, clear errors for models that do not split, and the shared-memory all-reduce's sums (SmolLM2
on three ranks, and a dead worker failing the engine: tests/test_pipeline_parallel.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from compiled import shm
from compiled.shm import ShmExchange
from engine import messages as m
from engine.config import EngineConfig, tensor_parallel_error
from engine.errors import EngineDeadError
from engine.executor import MultiprocExecutor
from engine.llm import LLM
from engine.params import SamplingParams
from engine.step import SchedulerOutput
from tests.conftest import TINY, children_of, engine_core_children

PROMPTS = [[(7 * i + 13 * j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
ENGINE = dict(dtype="float32", max_num_seqs=8, num_kv_blocks=128, max_num_batched_tokens=48)


def make_model(path: Path, kind: str, tokenizer_dir: str) -> str:
    """`split`: 2 KV heads split over 2 ranks (Llama, untied); `wide`: the same, twice as wide. `replicated`:
    1 KV head on both ranks, q/k/v biases and a tied vocabulary of 321 rows, padded to 2 x 161 (Qwen2).
    `five_layers`: a tied Llama of 5 layers, for pipeline stages. SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "split":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    elif kind == "five_layers":
        model = LlamaForCausalLM(LlamaConfig(**dict(TINY, num_hidden_layers=5), tie_word_embeddings=True))
    elif kind == "wide":
        cfg = dict(TINY, hidden_size=128, intermediate_size=256)
        model = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False))
    else:
        cfg = dict(TINY, vocab_size=321, num_key_value_heads=1)
        model = Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=True))
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.data.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir) -> dict[str, str]:
    return {k: make_model(tmp_path_factory.mktemp(k), k, smollm2_dir) for k in ("split", "replicated")}


@pytest.fixture(scope="module")
def one_process(models) -> dict[str, list]:
    """Each model's greedy outputs and prompt logprobs from one process (the reference)."""
    return {}


def run(model: str, **engine_args) -> list:
    with LLM(model, **ENGINE, **engine_args) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.get_stats()["kv_cache_usage"] == 0.0
    return outs


def assert_same(tp, one) -> None:
    for a, b in zip(tp, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got, want = a.prompt_logprobs[1:], b.prompt_logprobs[1:]
        assert len(got) == len(want)
        assert [[i for i, _ in g[1]] for g in got] == [[i for i, _ in w[1]] for w in want]  # the same top 2
        flat = [[g[0], *(lp for _, lp in g[1])] for g in got], [[w[0], *(lp for _, lp in w[1])] for w in want]
        np.testing.assert_allclose(*flat, atol=1e-4)


@pytest.mark.parametrize(
    "kind, enforce_eager",
    [("split", False), ("replicated", True)],  # split and eager: the torchrun test below
    ids=["split-compiled", "replicated-eager"],
)
def test_two_ranks_match_one_process(models, one_process, kind, enforce_eager):
    if kind not in one_process:
        one_process[kind] = run(models[kind], enforce_eager=True)
    assert_same(run(models[kind], enforce_eager=enforce_eager, tensor_parallel_size=2), one_process[kind])
    assert not engine_core_children()


def test_quantized_weights_split_by_whole_groups(tmp_path, smollm2_dir, monkeypatch):
    """int4 (groups of 32) on a model whose o- and down-projections split into whole groups per rank; the
    one process without the int8 GEMM copies that ranks do not make (compiled/loader.py)."""
    monkeypatch.setenv("KILN_INT8_GEMMS", "0")  # read by the engine cores' processes
    model, quantized = (
        make_model(tmp_path, "wide", smollm2_dir),
        dict(enforce_eager=True, quantization="int4"),
    )
    assert_same(run(model, tensor_parallel_size=2, **quantized), run(model, **quantized))


def test_models_that_do_not_split_are_refused_before_any_worker_starts(tmp_path, monkeypatch, smollm2_dir):
    assert tensor_parallel_error(9, 3, 1536, 3) is None  # SmolLM2 on 3 ranks
    assert tensor_parallel_error(8, 2, 64, 4) is None  # 2 KV heads, each replicated on 2 ranks
    assert "attention heads" in tensor_parallel_error(9, 3, 1536, 2)
    assert "key/value heads" in tensor_parallel_error(12, 3, 64, 4)
    assert "MLP width" in tensor_parallel_error(4, 2, 130, 4)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dict(TINY, num_attention_heads=2, num_key_value_heads=2))
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for f in Path(smollm2_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match="2 attention heads cannot be divided among tensor_parallel_size=4"):
        MultiprocExecutor(EngineConfig(tensor_parallel_size=4), str(tmp_path))
    assert not started
    monkeypatch.undo()
    with pytest.raises(EngineDeadError, match="cannot be divided"):
        LLM(str(tmp_path), tensor_parallel_size=4, enforce_eager=True)
    assert not engine_core_children()


def test_a_step_crosses_to_the_workers_intact():
    bitmask = np.array([-1, 5, 1 << 30], dtype=np.int32)
    so = SchedulerOutput(
        num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3, grammar_bitmasks={"a": bitmask}
    )
    frame = msgspec.msgpack.Encoder(enc_hook=m.encode_array).encode(m.ExecuteModel(so))
    got = msgspec.msgpack.Decoder(m.WorkerInput, dec_hook=m.decode_array).decode(frame).scheduler_output
    assert got.num_scheduled_tokens == {"a": 3} and got.finished_req_ids == set()
    assert (
        got.grammar_bitmasks["a"].dtype == np.int32 and got.grammar_bitmasks["a"].tolist() == bitmask.tolist()
    )


def workers_of(core: int) -> list[int]:
    return children_of(core, "compiled.worker")


def test_workers_that_torchrun_starts_on_two_hosts(models, one_process, tmp_path):
    """Two torchrun agents on loopback stand for two hosts, each a pipeline stage of two tensor-parallel
    ranks; the engine core waits for them at its worker address, with the cluster's key. As on two hosts,
    the ranks talk through gloo, not shared memory. Strangers at the worker address neither join, read
    steps nor forge replies; a worker stopped (as a vanished host would be) fails the engine within 10 s,
    naming it, and the other workers exit."""
    from engine.processes import free_port
    from tests.test_cluster import key_file, strangers
    from tests.test_data_parallel import listening_port

    port, key = listening_port(), key_file(tmp_path)
    address = f"tcp://127.0.0.1:{port}"
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--nproc-per-node", "2"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    worker = ["-m", "compiled.worker", "--connect", address, "--cluster-key-file", key]
    hosts = [
        subprocess.Popen(
            [*torchrun, "--node-rank", str(i), *rendezvous, *worker],
            env=dict(os.environ, KILN_SHM_COLLECTIVES="0"),
        )
        for i in range(2)
    ]
    pulls = []
    try:
        llm = LLM(
            models["split"],
            **ENGINE,
            enforce_eager=True,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            worker_address=address,
            cluster_key_file=key,
        )
        pulls = strangers(port)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert not any(pull.poll(0) for pull in pulls)
        stopped = workers_of(hosts[1].pid)[0]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"kiln worker [23] on .* went away"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
        llm.shutdown()
        others = [w for host in hosts for w in workers_of(host.pid) if w != stopped]
        os.kill(stopped, signal.SIGKILL)  # its host never comes back: the other workers go too
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{w}").exists() for w in others) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for host in hosts for w in workers_of(host.pid) if w != stopped]
    finally:
        for host in hosts:
            host.kill()
        for sock in pulls:
            sock.close(linger=0)
    if "split" not in one_process:
        one_process["split"] = run(models["split"], enforce_eager=True)
    assert_same(outs, one_process["split"])


@pytest.mark.skipif(not shm.supported(), reason="shared-memory collectives are for x86 hosts")
def test_shared_memory_all_reduce_sums_every_rank_equally(tmp_path):
    """Two ranks on threads: each call's sum equals float32's sum rounded once, on both ranks, through
    both banks and the slot views each shape keeps (shapes interleaved, more calls than banks)."""
    path = tmp_path / "exchange"
    path.write_bytes(b"\0" * shm.file_bytes(2))
    ranks = [ShmExchange(r, 2, str(path)) for r in range(2)]
    gen = torch.Generator().manual_seed(0)
    calls = [
        [torch.randn(shape, generator=gen).to(dtype) * 100 for _ in range(2)]
        for dtype in (torch.float32, torch.bfloat16)
        for shape in ((1, 576), (7, 576), (1, 576), (3, 5, 8))
        for _ in range(2)
    ]
    results: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        for parts in calls:
            results[rank].append(ranks[rank].all_reduce(parts[rank]))

    # Daemons: a rank left waiting for its peer must fail the test, not hold the session at exit.
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results[0]) == len(results[1]) == len(calls)
    for parts, got0, got1 in zip(calls, *results):
        expected = (parts[0].float() + parts[1].float()).to(parts[0].dtype)
        assert got0.dtype == expected.dtype and torch.equal(got0, expected) and torch.equal(got1, expected)


@pytest.mark.skipif(not shm.supported(), reason="shared-memory collectives are for x86 hosts")
def test_the_shared_memory_file_is_never_open_to_other_users(monkeypatch, tmp_path):
    """Its mode while it exists under /dev/shm (every rank's activations pass through it), under the
    usual umask; and a name someone else made first is never reused."""
    from compiled import parallel

    modes, unlink = [], os.unlink

    def unlinked(path):
        modes.append(os.stat(path).st_mode & 0o777)
        unlink(path)

    monkeypatch.setattr(parallel.dist, "broadcast", lambda *a, **k: None)  # one rank: nothing to exchange
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(parallel.os, "unlink", unlinked)
    umask = os.umask(0o022)
    try:
        exchange = parallel._open_shm(0, 1)
    finally:
        os.umask(umask)
    assert exchange is not None and modes == [0o600]
    taken = tmp_path / "taken"
    taken.write_bytes(b"")
    with pytest.raises(FileExistsError):
        shm.create(str(taken), 1)
