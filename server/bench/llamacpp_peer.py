"""llama.cpp as a batch-1 peer: run by the peer's own Python (llama-cpp-python, ../shared/peers), never
imported by kiln. Reads one JSON request a line on stdin ({"prompt": [token ids], "output_len": n}) and
answers each with {"ttft_s": ..., "decode_tok_s": ...} on stdout, greedy and past EOS, with no prompt
cache carried from one request to the next.

    python llamacpp_peer.py MODEL.gguf THREADS N_CTX
"""

import json
import sys
import time

import llama_cpp


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def without_extra_buffers():  # ggml's AMX matmul crashed on Q4_1 weights on some machines
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm.reset()
        start, times = time.perf_counter(), []
        for _ in llm.generate(request["prompt"], temp=0.0, top_k=1):
            times.append(time.perf_counter())
            if len(times) == request["output_len"]:
                break
        decode = (len(times) - 1) / (times[-1] - times[0])
        print(json.dumps({"ttft_s": times[0] - start, "decode_tok_s": decode}), flush=True)


if __name__ == "__main__":
    main()
