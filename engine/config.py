"""Engine arguments, shared by the front end, the engine core and the worker; torch-free.

Each field's `Meta(description=...)` is its command-line help: `kiln`'s engine flags are generated
from these fields (server/cli.py), so the flags and the config cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, get_type_hints

import msgspec

SCHEDULING_POLICIES = ("fcfs", "priority")


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Draft-free speculative decoding, as vLLM's `--speculative-config` names it (engine/proposer.py)."""

    method: str = "ngram"  # ngram (prompt lookup) or suffix (suffix decoding)
    num_speculative_tokens: int = 4  # drafted tokens verified per step, at most
    prompt_lookup_min: int = 2  # ngram: n-gram lengths matched, longest first
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 12  # suffix: the longest context matched, in tokens
    suffix_decoding_max_cached_requests: int = 1000  # suffix: recent requests whose outputs are drafted from
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: draft length at most this times the context's
    suffix_decoding_min_token_prob: float = 0.1  # suffix: the draft stops below this estimated probability

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "suffix"):
            raise ValueError(f"method must be ngram or suffix (got {self.method!r})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1, max_cached_requests >= 0")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("need suffix_decoding_max_spec_factor > 0 and min_token_prob in [0, 1]")


class EngineConfig(msgspec.Struct, kw_only=True):
    """Names follow vLLM's engine arguments where they exist. None budgets are resolved by the engine
    core once it knows the device (`resolved`), and reported back to the front end."""

    model: str | None = None  # HF directory, .gguf file, or None for the embedded default
    served_model_name: str | None = None
    dtype: Annotated[
        str,
        _help(
            "auto (bfloat16 where the hardware computes it fast, else float32), float32, bfloat16 or float16"
        ),
    ] = "auto"
    device: Annotated[str, _help("auto, cpu or cuda")] = "auto"
    quantization: Annotated[
        str,
        _help(
            "auto (a .gguf model's own Q4_0/Q4_1/Q8_0 blocks on a CPU with VNNI or AMX, in one process, "
            "unless --dtype names the weights' dtype; else none), none (weights in dtype), gguf (compute "
            "on a GGUF file's own Q4_0/Q4_1/Q8_0 blocks), "
            "int8 (groups of 64), int4 (groups of 32) or w8a8 (int8 weights per channel times int8 "
            "activations per token, CPU)"
        ),
    ] = "auto"
    max_model_len: Annotated[int | None, _help("context length (default: the model's)")] = None
    block_size: Annotated[int | None, _help("tokens per KV-cache block (default: CPU 64, CUDA 16)")] = None
    max_num_seqs: Annotated[
        int | None, _help("sequences one step may compute (default: 256 offline, 64 when serving)")
    ] = None
    max_num_batched_tokens: Annotated[
        int | None,
        _help(
            "tokens one step may compute (default: 4096 offline and 2048 serving on CPU, 8192 on CUDA or "
            "without chunked prefill)"
        ),
    ] = None
    max_num_batched_tokens_decoding: Annotated[
        int | None,
        _help(
            "tokens of a step that carries decodes (default when serving: 64 on CPU, 2048 on CUDA; "
            "offline: no extra limit)"
        ),
    ] = None
    step_stretch: Annotated[
        float,
        _help(
            "CPU serving without --max-num-batched-tokens-decoding: a step that carries a prompt chunk may "
            "take this many times a decode-only step's measured time, more while requests wait (its budget "
            "follows; at least 64 tokens). 0: a fixed 64"
        ),
    ] = 4.0
    async_scheduling: Annotated[
        bool | None,
        _help(
            "schedule the next step while the model runs the current one (default: on for CUDA, "
            "off on CPU, where the scheduler would take cores from the model)"
        ),
    ] = None
    scheduling_policy: Annotated[
        str,
        _help(
            "fcfs (first come, first served) or priority (by each request's priority, lower first, then "
            "arrival; under memory pressure the lowest-priority running request is preempted)"
        ),
    ] = "fcfs"
    pooling: Annotated[
        str,
        _help("how embeddings (LLM.embed, /v1/embeddings) pool the final hidden states: last or mean"),
    ] = "last"
    usage: str = "offline"  # offline (LLM) | serving (AsyncLLM, kiln serve): which defaults apply
    enable_prefix_caching: Annotated[bool, _help("reuse the KV of shared prompt prefixes")] = True
    enable_chunked_prefill: Annotated[bool, _help("split long prompts over several steps")] = True
    long_prefill_token_threshold: Annotated[int, _help("cap on one prompt's chunk (0: the step budget)")] = 0
    kv_cache_memory: Annotated[
        int | None, _help("bytes for the KV cache (default: sized from the device)")
    ] = None
    gpu_memory_utilization: Annotated[float, _help("CUDA: fraction of device memory kiln may use")] = 0.9
    cpu_kv_cache_fraction: Annotated[float, _help("CPU: fraction of available RAM for the KV cache")] = 0.25
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides the memory-based sizing
    enforce_eager: Annotated[bool, _help("skip torch.compile")] = False
    num_threads: Annotated[
        int | None, _help("engine-core torch threads (default: the cores other processes leave free)")
    ] = None
    tensor_parallel_size: Annotated[
        int, _help("worker processes the model is split across, one per device (CPU: the cores shared)")
    ] = 1
    pipeline_parallel_size: Annotated[
        int,
        _help(
            "stages the layers are split into, each tensor_parallel_size worker processes wide, with as many "
            "steps in flight (CPU: the cores shared)"
        ),
    ] = 1
    pipeline_layer_partition: Annotated[
        str | None,
        _help("layers of each pipeline stage, comma-separated, e.g. 10,14 (default: as even as can be)"),
    ] = None
    worker_address: Annotated[
        str | None,
        _help(
            "tcp://HOST:PORT where the engine core waits for tensor-parallel workers started elsewhere "
            "(torchrun ... -m compiled.worker --connect tcp://HOST:PORT; PORT+1 is used too), "
            "instead of starting them itself"
        ),
    ] = None
    data_parallel_size: Annotated[
        int,
        _help(
            "engine cores, each a model replica with its own scheduler, behind one front end "
            "(CPU: the cores shared)"
        ),
    ] = 1
    data_parallel_rank: int = 0  # which of this host's engine cores: its share of the cores or devices
    engine_core_addresses: Annotated[
        str | None,
        _help(
            "comma-separated tcp://HOST:PORT of engine cores started with `kiln serve --headless` "
            "(PORT+1 is used too), to serve with instead of starting cores here"
        ),
    ] = None
    cluster_key_file: Annotated[
        str | None,
        _help(
            "a file holding the cluster's shared secret (`kiln cluster-key` makes one; default: "
            "$KILN_CLUSTER_KEY): connections to headless cores and workers elsewhere are encrypted and "
            "open only to its holders; required to listen beyond loopback"
        ),
    ] = None
    speculative_config: Annotated[
        SpeculativeConfig | None,
        _help(
            'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\': drafts '
            "from each request's own tokens (ngram: prompt lookup; suffix: also recent requests' outputs), "
            "verified in one forward, output unchanged"
        ),
    ] = None
    # One of the processes of `kiln serve --api-server-count`: "DIR:CLIENT:CLIENTS", the launcher's directory,
    # this process's client index (0: the launcher, which starts the cores) and the number of clients.
    api_server: str | None = None
    max_pending_requests: Annotated[
        int, _help("streaming front ends: samples held beyond max_num_seqs before more are refused (429)")
    ] = 4096
    max_pending_tokens: Annotated[
        int | None,
        _help(
            "streaming front ends: prompt tokens of every sample in flight before more are refused (429); "
            "default 16 times the KV cache's tokens"
        ),
    ] = None
    max_pending_constraint_bytes: Annotated[
        int, _help("streaming front ends: bytes of structured-output constraints in flight (429 past it)")
    ] = 16 << 20

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str | dict):  # JSON from the command line, a dict from Python
            spec = self.speculative_config
            try:
                spec = msgspec.json.decode(spec) if isinstance(spec, str) else spec
                self.speculative_config = msgspec.convert(spec, SpeculativeConfig)
            except msgspec.MsgspecError as e:
                raise ValueError(f"speculative_config: {e}") from None

        def check(ok: object, field: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{field} {message} (got {getattr(self, field)!r})")

        tcp = re.compile(r"tcp://[^:/]+:\d+").fullmatch
        budget, addresses = self.max_num_batched_tokens, self.engine_core_addresses
        check(
            self.block_size in (None, 8, 16, 32, 64, 128), "block_size", "must be one of 8, 16, 32, 64, 128"
        )
        check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        check(self.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")
        check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be at least 1")
        parts = (self.pipeline_layer_partition or "").split(",")
        ok = self.pipeline_layer_partition is None or (
            len(parts) == self.pipeline_parallel_size and all(p.isdigit() and int(p) > 0 for p in parts)
        )
        check(ok, "pipeline_layer_partition", "must be pipeline_parallel_size positive layer counts")
        ok = self.worker_address is None or tcp(self.worker_address)
        check(ok, "worker_address", "must be tcp://HOST:PORT")
        ok = addresses is None or all(map(tcp, addresses.split(",")))
        check(ok, "engine_core_addresses", "must be tcp://HOST:PORT, comma-separated")
        ok = addresses is None or self.data_parallel_size == 1
        check(
            ok, "data_parallel_size", "must be 1 with engine_core_addresses (each address is one engine core)"
        )
        check(self.usage in ("offline", "serving"), "usage", "must be offline or serving")
        check(self.pooling in ("last", "mean"), "pooling", "must be last or mean")
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", "must be fcfs or priority")
        check(budget is None or budget >= 1, "max_num_batched_tokens", "must be at least 1")
        check(self.step_stretch == 0 or self.step_stretch >= 1, "step_stretch", "must be 0 or at least 1")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be at least 2")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        check(0.0 < self.cpu_kv_cache_fraction < 1.0, "cpu_kv_cache_fraction", "must be in (0, 1)")
        check(
            self.quantization in ("auto", "none", "gguf", "int8", "int4", "w8a8"),
            "quantization",
            "must be auto, none, gguf, int8, int4 or w8a8",
        )
        check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            "must be auto, cpu or cuda",
        )

    def resolved(self, on_cuda: bool) -> EngineConfig:
        """This config with its None step limits and block size filled in for its usage and the device."""
        offline = self.usage == "offline"
        # Offline, wider decode batches finish a batch sooner; serving, each step holds every running stream's
        # next token, and a wider step holds them longer.
        seqs = self.max_num_seqs or (256 if offline else 64)
        # A CPU step is slow per prompt token; serving, a burst of prompts goes in steps of 2048 (as in
        # vLLM's CPU backend); without chunked prefill a prompt must fit one step.
        budget = (4096 if offline else 2048) if self.enable_chunked_prefill and not on_cuda else 8192
        budget = self.max_num_batched_tokens or max(budget, seqs)  # room for every sequence's decode
        decoding = self.max_num_batched_tokens_decoding
        serving = self.usage == "serving" and self.enable_chunked_prefill
        if decoding is None:
            # Serving: a new prompt holds running streams' next tokens for a fraction of a second at
            # most; offline, larger chunks finish a batch sooner.
            decoding = (2048 if on_cuda else 64) if serving else 0
        overlap = on_cuda if self.async_scheduling is None else self.async_scheduling
        # On CPU the budget follows the measured step times (StepBudget), read as each step ends:
        # overlapped steps would blur them.
        measured = serving and self.max_num_batched_tokens_decoding is None and not on_cuda and not overlap
        measured = measured and self.pipeline_parallel_size == 1  # pipelined steps overlap too
        return msgspec.structs.replace(
            self,
            # CPU decode attention reads each page as one stream: 64-token pages read faster than 16-token
            # ones scattered over the cache, and prefixes are still shared 64 tokens at a time.
            block_size=self.block_size or (16 if on_cuda else 64),
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_num_batched_tokens_decoding=decoding,
            async_scheduling=overlap,
            step_stretch=self.step_stretch if measured else 0.0,
        )


@dataclass(kw_only=True)
class SchedulerConfig:
    max_model_len: int
    num_blocks: int  # including the null block
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk is limited by the budget only
    # A step that carries decodes computes at most this many tokens (0: max_num_batched_tokens), so a
    # prefill never holds running streams' next tokens for long; a step with nobody decoding may use
    # the whole budget, which is what a lone prompt's time to first token needs (with step_stretch, a
    # few times a step's fixed cost: engine/step_budget.py).
    max_num_batched_tokens_decoding: int = 0
    settling_tokens: int = 0  # streams cap steps from this many tokens on: a burst prefills in full steps
    async_scheduling: bool = False  # schedule the next step while the current one runs
    # Pipeline stages: as many steps in flight, each request in one at a time, a share of the running in each.
    pipeline_parallel_size: int = 1
    scheduling_policy: str = "fcfs"  # or "priority": by each request's priority, then arrival
    step_stretch: float = 0.0  # CPU serving: the decoding budget follows measured step times (StepBudget)

    @classmethod
    def of(cls, c: EngineConfig, max_model_len: int, num_blocks: int, settling: int) -> SchedulerConfig:
        """The scheduler's part of an engine config whose budgets are resolved."""
        names = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "long_prefill_token_threshold",
            "max_num_batched_tokens_decoding",
            "async_scheduling",
            "pipeline_parallel_size",
            "scheduling_policy",
            "step_stretch",
        )
        return cls(
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            settling_tokens=settling,
            **{name: getattr(c, name) for name in names},
        )

    def __post_init__(self) -> None:
        lows = dict(max_model_len=2, num_blocks=2, max_num_seqs=1, max_num_batched_tokens=1, block_size=1)
        counts = ("long_prefill_token_threshold", "max_num_batched_tokens_decoding", "settling_tokens")
        for name, low in {**lows, **dict.fromkeys(counts, 0)}.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")


def cli_fields() -> dict[str, tuple[type, object, str]]:
    """The fields that are command-line flags: name -> (type, default, help)."""
    hints = get_type_hints(EngineConfig, include_extras=True)
    defaults = EngineConfig()
    fields = {}
    for name in EngineConfig.__struct_fields__:
        if metas := [m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, msgspec.Meta)]:
            base = hints[name].__origin__
            kind = next((t for t in getattr(base, "__args__", (base,)) if t is not type(None)), base)
            fields[name] = (kind, getattr(defaults, name), metas[0].description)
    return fields


def tensor_parallel_error(n_heads: int, n_kv_heads: int, intermediate_size: int, size: int) -> str | None:
    """Why a model cannot be split across `size` ranks (None when it can): each rank takes whole query
    heads and an equal share of the MLP, and either whole KV heads or one KV head replicated."""
    if n_heads % size:
        return f"its {n_heads} attention heads cannot be divided among tensor_parallel_size={size} ranks"
    if n_kv_heads % size and size % n_kv_heads:
        return (
            f"its {n_kv_heads} key/value heads can be neither divided among nor replicated across "
            f"tensor_parallel_size={size} ranks"
        )
    if intermediate_size % size:
        return f"its MLP width {intermediate_size} cannot be divided among tensor_parallel_size={size} ranks"
    return None


def pipeline_partition(n_layers: int, size: int, counts: str | None = None) -> list[int]:
    """Each stage's number of layers: `counts` (comma-separated) where given, else as even as can be, the
    stages before the last taking one more each where the layers do not divide evenly (the last stage
    computes the LM head besides)."""
    if counts:
        parts = [int(c) for c in counts.split(",")]
        if len(parts) != size or sum(parts) != n_layers or min(parts) < 1:
            raise ValueError(
                f"pipeline_layer_partition={counts!r} does not split the model's {n_layers} layers "
                f"into {size} stages of at least one layer"
            )
        return parts
    if n_layers < size:
        raise ValueError(f"the model's {n_layers} layers cannot fill pipeline_parallel_size={size} stages")
    parts = [n_layers // size] * size
    for i in range(n_layers % size):
        parts[-2 - i] += 1
    return parts
