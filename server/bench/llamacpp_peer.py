"""llama.cpp as a batch-1 peer: run by the peer's own Python (llama-cpp-python, ../shared/peers), never
imported by kiln. Reads one JSON request a line on stdin ({"prompt": [token ids], "output_len": n}, and
optionally "stop": [token ids] to end at, "lookup": true for its prompt-lookup drafts) and answers each
with {"ttft_s": ..., "decode_tok_s": ..., "seconds": ..., "tokens": [ids]} on stdout, greedy (past EOS
unless "stop" names it), with no prompt cache carried from one request to the next.

    python llamacpp_peer.py MODEL.gguf THREADS N_CTX [LOOKUP_TOKENS LOOKUP_NGRAM]

With the last two, a second model drafts by prompt lookup (`LlamaPromptLookupDecoding`: up to
LOOKUP_TOKENS tokens after the latest n-gram of at most LOOKUP_NGRAM tokens found earlier).
"""

import json
import sys
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def without_extra_buffers():  # ggml's AMX matmul crashed on Q4_1 weights on some machines
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
    args = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    engines = {False: llama_cpp.Llama(path, **args)}
    if len(sys.argv) > 5:  # a model of its own: drafting makes it keep every position's logits
        lookup = LlamaPromptLookupDecoding(max_ngram_size=int(sys.argv[5]), num_pred_tokens=int(sys.argv[4]))
        engines[True] = llama_cpp.Llama(path, draft_model=lookup, **args)
    print(json.dumps({"ready": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm, stop = engines[bool(request.get("lookup"))], set(request.get("stop", ()))
        llm.reset()
        start, times, tokens = time.perf_counter(), [], []
        for token in llm.generate(request["prompt"], temp=0.0, top_k=1):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(times) == request["output_len"] or token in stop:
                break
        decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        answer = {"ttft_s": times[0] - start, "decode_tok_s": decode, "seconds": times[-1] - start}
        print(json.dumps({**answer, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
