"""Every message that crosses the front end <-> engine core boundary: msgspec Structs, msgpack-encoded.

Never pickle: a frame decodes only into these types (a tagged union), anything else is an error.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

# ---- front end -> engine core ----------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, tag=True, array_like=True):
    """One prompt and its `sampling_params.n` samples, sent once: the core runs each sample as a request of
    its own (`samples()`), all sharing the prompt and the constraint rather than carrying copies."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    cache_salt: str | None = None
    client: int = 0  # the API server it came from (`kiln serve --api-server-count`): its outputs go there

    def sample_ids(self) -> list[str]:
        """The samples' request ids: the request's own for one sample, "<id>#<i>" for several."""
        n = self.sampling_params.n
        return [self.request_id] if n == 1 else [f"{self.request_id}#{i}" for i in range(n)]

    def samples(self) -> list[EngineCoreRequest]:
        """One request per sample: sample i draws with seed + i, and only the first computes the prompt's
        logprobs (the same for all)."""
        p = self.sampling_params
        if p.n == 1:
            return [self]
        out = []
        for i, rid in enumerate(self.sample_ids()):
            seed = None if p.seed is None else p.seed + i
            params = msgspec.structs.replace(
                p, n=1, seed=seed, prompt_logprobs=p.prompt_logprobs if i == 0 else None
            )
            out.append(msgspec.structs.replace(self, request_id=rid, sampling_params=params))
        return out


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    """Ask the core to run `method` (one of EngineCore.UTILITIES); answered by a UtilityResult."""

    call_id: int
    method: str
    args: list[Any] = []
    client: int = 0  # the API server that asks: the result goes there


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class StartCore(msgspec.Struct, tag=True, array_like=True):
    """The first message a new engine-core process receives: how to build itself."""

    config: EngineConfig
    model_dir: str
    gguf_file: str | None = None  # to convert into model_dir first (its first start)
    engine_index: int = 0  # which of the front end's engine cores (data parallelism) this one is
    publish_kv_events: bool = False  # its prefix cache's changes, for the coordinator (several cores)
    session: bytes = b""  # a headless core's front end: the routing id its outputs go to


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """A front end's sign of life to a headless core, which stops once they cease (engine/cluster.py)."""

    session: bytes = b""  # the front end's StartCore.session: another front end's heartbeat is not one


class Hello(msgspec.Struct, tag=True, array_like=True):
    """An API server's first message to a core started for several (`kiln serve --api-server-count`):
    the core answers with its CoreReady once it is ready, and sends the client its requests' outputs."""

    client: int


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown | StartCore | Heartbeat | Hello


# ---- engine core -> front end ----------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since the last output, and its finish reason once it ends."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None  # first time the request was scheduled (with its first output)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first output, when asked for
    spec_decoding: tuple[int, int] | None = None  # drafted and accepted tokens, with the last output
    pooled: list[float] | None = None  # a pooling request's embedding, its one output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class KVCacheEvents(msgspec.Struct, array_like=True):
    """A core's prefix-cache changes since its last ones (engine/block_pool.py): a reset first, then the
    block hashes evicted and those stored; a hash is in one list at most."""

    reset: bool
    removed: list[bytes]
    stored: list[bytes]


class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    engine_index: int = 0
    kv_cache_usage: float = 0.0  # as the step that produced these left it: load for the coordinator
    kv_events: KVCacheEvents | None = None  # published for the coordinator when there are several cores


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None
    engine_index: int = 0


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """Sent once the model is loaded, the KV cache allocated and every graph compiled."""

    config: EngineConfig  # with the budgets resolved for the device
    num_kv_blocks: int
    max_model_len: int
    dtype: str
    device: str
    vocab_size: int  # the model's: token ids at or past it have no embedding
    engine_index: int = 0


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core hit an error it cannot continue after (sent before it exits)."""

    message: str
    engine_index: int = 0


CoreOutput = EngineCoreOutputs | UtilityResult | CoreReady | CoreFailed


# ---- engine core -> DP coordinator -> API servers ---------------------------------------------------


class CoreLoad(msgspec.Struct, tag=True, array_like=True):
    """A core's load and its prefix cache's changes since its last CoreLoad, for the DP coordinator
    (engine/coordinator.py), which passes them on to every API server; a late subscriber gets each core's
    whole cache as one reset-and-store."""

    engine_index: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_events: KVCacheEvents | None = None


# ---- engine core <-> worker processes (tensor parallelism) --------------------------------------


class StartWorker(msgspec.Struct, tag=True, array_like=True):
    config: EngineConfig
    model_dir: str
    gguf_file: str | None = None


class WorkerCall(msgspec.Struct, tag=True, array_like=True):
    """Run the worker method `method` (plain values in and out) on every rank; each answers."""

    method: str
    args: list[Any] = []


class ExecuteModel(msgspec.Struct, tag=True, array_like=True):
    """One step on every rank; rank 0 answers with its sampled tokens."""

    scheduler_output: SchedulerOutput


WorkerInput = StartWorker | WorkerCall | ExecuteModel | Shutdown


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    rank: int
    config: EngineConfig  # with the budgets resolved for the device
    max_model_len: int
    dtype: str
    device: str
    vocab_size: int


class WorkerReply(msgspec.Struct, tag=True, array_like=True):
    rank: int
    result: Any = None
    error: str | None = None  # the worker failed and is exiting


class WorkerStepOutput(msgspec.Struct, tag=True, array_like=True):
    output: ModelRunnerOutput


WorkerOutput = WorkerReady | WorkerReply | WorkerStepOutput


def encode_array(obj: Any) -> Any:
    """msgspec's enc_hook for the numpy arrays a step carries (grammar bitmasks): dtype, shape, bytes."""
    if isinstance(obj, np.ndarray):
        return [obj.dtype.str, list(obj.shape), obj.tobytes()]
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def decode_array(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind.__name__}")
