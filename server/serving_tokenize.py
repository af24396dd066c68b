"""/tokenize and /detokenize: the tokenizer's work on a lane thread (server/serving.py, whose queue limits
bound what waits for it), and a large reply built off the event loop (server/replies.py).

A /detokenize request holds at most the model's context in tokens: the tokenizer's decode holds the GIL
throughout, so a body of millions of ids would stop the event loop however it is scheduled; and its body
is refused (413) past BYTES_PER_ID bytes an id, before the loop spends time parsing it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server import replies
from server.errors import APIError
from server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.serving import Serving

BYTES_PER_ID = 32  # a token id in JSON, with room to spare for its separator and whitespace


class TokenizeServing:
    def __init__(self, serving: Serving) -> None:
        self.s = serving

    async def tokenize(self, request: Request) -> Response:
        s = self.s
        b: TokenizeRequest = await s.read(request, TokenizeRequest)
        if b.messages is not None:
            ids = await s.offload(s.chat_ids, b.messages, b.add_generation_prompt is not False, None)
        elif b.prompt is not None:
            special = b.add_special_tokens is not False
            try:
                ids = await s.offload(s.llm.processor.encode, b.prompt, special)
            except APIError:
                raise
            except Exception as e:
                raise APIError(400, f"could not tokenize the prompt: {e}", "prompt") from None
        else:
            raise APIError(400, "either prompt or messages is required", "prompt")
        return await replies.respond(len(ids), self._tokenized, ids, bool(b.return_token_strs))

    def _tokenized(self, ids: list[int], with_strings: bool) -> TokenizeResponse:
        strs = [self.s.tokens.text(t) for t in ids] if with_strings else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.s.llm.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: Request) -> Response:
        s = self.s
        limit = s.llm.max_model_len
        b: DetokenizeRequest = await s.read(request, DetokenizeRequest, BYTES_PER_ID * limit + 4096)
        if len(b.tokens) > limit:
            raise APIError(
                400, f"tokens holds {len(b.tokens)} ids; at most {limit} (the model's context) are", "tokens"
            )
        processor = s.llm.processor

        def decode() -> str:
            vocab = processor.vocab_size
            for i, t in enumerate(b.tokens):
                if not 0 <= t < vocab:
                    raise APIError(
                        400, f"tokens[{i}]={t} is not a token id (the vocabulary has {vocab})", "tokens"
                    )
            return processor.tokenizer.decode(b.tokens)

        text = await s.offload(decode)
        return await replies.respond(len(b.tokens), lambda: DetokenizeResponse(prompt=text))
