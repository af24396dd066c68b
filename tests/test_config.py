"""Engine arguments: the engine flags are EngineConfig's fields, and budgets resolve per device."""

import argparse

import pytest

from engine.config import EngineConfig, SchedulerConfig, cli_fields
from server.cli import add_engine_args, engine_args, engine_flags


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(flags))


def test_every_engine_flag_is_a_config_field_with_its_default():
    args = engine_args(parse())
    assert set(args) == set(cli_fields()) and {"dtype", "max_num_seqs", "enforce_eager"} <= set(args)
    defaults = EngineConfig()
    assert all(getattr(defaults, name) == value for name, value in args.items())


def test_flags_round_trip_into_the_config():
    flags = [
        "--max-num-seqs",
        "3",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--cpu-kv-cache-fraction",
        "0.5",
    ]
    ns = parse(*flags)
    config = EngineConfig(**engine_args(ns))
    assert (config.max_num_seqs, config.enable_prefix_caching, config.enforce_eager) == (3, False, True)
    assert config.cpu_kv_cache_fraction == 0.5
    assert sorted(engine_flags(ns)) == sorted(flags)


def test_budgets_resolve_for_the_device():
    offline, serving = EngineConfig(), EngineConfig(usage="serving")
    assert offline.max_num_batched_tokens is None  # left to the engine core, which knows the device
    assert offline.max_num_seqs is None
    # Offline steps are as wide as vLLM's LLM defaults; serving ones narrower, for inter-token latency.
    assert offline.resolved(on_cuda=False).max_num_seqs == 256
    assert serving.resolved(on_cuda=False).max_num_seqs == 64
    assert offline.resolved(on_cuda=False).max_num_batched_tokens == 4096
    assert serving.resolved(on_cuda=False).max_num_batched_tokens == 2048
    assert EngineConfig(max_num_seqs=3).resolved(on_cuda=False).max_num_seqs == 3
    assert offline.resolved(on_cuda=True).max_num_batched_tokens == 8192
    assert offline.resolved(on_cuda=False).max_num_batched_tokens_decoding == 0
    assert serving.resolved(on_cuda=False).max_num_batched_tokens_decoding == 64
    assert serving.resolved(on_cuda=True).max_num_batched_tokens_decoding == 2048
    # CPU serving measures its steps and sizes chunks from them, unless a budget is given or steps overlap.
    assert serving.resolved(on_cuda=False).step_stretch == 4.0
    for fixed in (
        EngineConfig(usage="serving", max_num_batched_tokens_decoding=64),
        EngineConfig(usage="serving", async_scheduling=True),
        offline,
    ):
        assert fixed.resolved(on_cuda=False).step_stretch == 0
    assert serving.resolved(on_cuda=True).step_stretch == 0
    assert EngineConfig(max_num_seqs=5000).resolved(on_cuda=False).max_num_batched_tokens == 5000
    assert EngineConfig(enable_chunked_prefill=False).resolved(on_cuda=False).max_num_batched_tokens == 8192
    # KV pages: larger on CPU, where decode attention reads each page as one stream; a given size stays.
    assert offline.block_size is None
    assert offline.resolved(on_cuda=False).block_size == 64
    assert offline.resolved(on_cuda=True).block_size == 16
    assert EngineConfig(block_size=16).resolved(on_cuda=False).block_size == 16


def test_a_bad_value_names_its_field():
    with pytest.raises(ValueError, match="block_size must be one of"):
        EngineConfig(block_size=7)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="worker_address must be tcp://HOST:PORT"):
        EngineConfig(worker_address="127.0.0.1:5555")
    assert EngineConfig(worker_address="tcp://0.0.0.0:5555").worker_address == "tcp://0.0.0.0:5555"


def test_scheduling_policy_is_a_flag_and_only_fcfs_or_priority():
    assert EngineConfig().scheduling_policy == "fcfs"
    ns = parse("--scheduling-policy", "priority")
    assert EngineConfig(**engine_args(ns)).scheduling_policy == "priority"
    assert engine_flags(ns) == ["--scheduling-policy", "priority"]
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority"):
        SchedulerConfig(max_model_len=16, num_blocks=4, scheduling_policy="PRIORITY")
