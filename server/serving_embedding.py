"""/v1/embeddings: each input's final hidden states pooled by the engine (a prefill with nothing sampled,
scheduled with the generating requests)."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from server.errors import APIError, json_response, short
from server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from server.serving import Serving
from server.serving_completion import count_prompts, parse_prompts


class EmbeddingServing:
    def __init__(self, serving: Serving) -> None:
        self.s = serving

    async def create(self, request: Request) -> Response:
        s = self.s
        b: EmbeddingRequest = await s.read(request, EmbeddingRequest)
        if b.dimensions is not None:
            raise APIError(
                400, "dimensions is not supported: this model's embeddings have one size", "dimensions"
            )
        if b.encoding_format not in (None, "float", "base64"):
            raise APIError(
                400,
                f"encoding_format must be 'float' or 'base64' (got {short(b.encoding_format)})",
                "encoding_format",
            )
        params = s.llm.embedding_params(b.normalize is not False)
        s.limits.check_size(count_prompts(b.input), params, stream=False)
        prompts = await s.offload(parse_prompts, s.tokenize, b.input, "input")
        rid = f"embd-{uuid.uuid4().hex}"
        prepared = [s.prepare(f"{rid}-{i}", p.ids, params, b.cache_salt) for i, p in enumerate(prompts)]
        finals = await s.until_disconnected(request, s.collect(s.generate_all(prepared)))
        if any(f.embedding is None for f in finals):  # aborted in the engine (it is shutting down)
            raise APIError(503, "the engine ended the request before its embedding was computed")
        data = [
            EmbeddingData(index=i, embedding=_encoded(f.embedding, b.encoding_format))
            for i, f in enumerate(finals)
        ]
        n = sum(len(p.ids) for p in prompts)
        usage = EmbeddingUsage(prompt_tokens=n, total_tokens=n)
        body = EmbeddingResponse(
            id=rid, object="list", created=int(time.time()), model=s.model_name, data=data, usage=usage
        )
        return json_response(body)


def _encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
