"""One bench big run of vLLM, executed by the python of vLLM's own venv (`runtime.bench.vllm.venv`): it imports the
standard library and vllm only, never expertcache (which that venv does not hold).

    python vllm_driver.py '{"model": DIR, "phase": "decode"|"prefill", "prompt_ids": [...], "warmup": W,
                            "tokens": N, "max_model_len": L}'

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller), so the caller's wait4 sees
its peak RSS and reads, and a memory cgroup the caller joined holds all of it. The checkpoint is loaded with no
tokenizer (`skip_tokenizer_init`: the prompt is token ids, the output is never detokenized), bf16, one sequence,
no prefix cache, greedy, end-of-sequence ignored. One request is stepped through `LLMEngine.step`, each step
stamped when it brings a new token:

- decode: the prompt, then `warmup` untimed tokens, then `tokens` timed ones; `tpot_s` = the gaps between the
  stamps of the timed tokens (one step each: batch of one).
- prefill: the prompt and one token; `ttft_s` = from the request's arrival to its first token.

Prints one line `RESULT <json>` last: `load_s`, `tpot_s` or `ttft_s`, `output_ids`, `vllm_version`, and this
process's own peak resident set (`peak_rss_bytes`, VmHWM: the caller's rusage would also count what the caller
held when it forked). Then it exits at once: nothing it measured depends on vLLM's shutdown, which may linger.
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # this folder's vllm.py is not vllm


def main() -> int:
    cfg = json.loads(sys.argv[1])
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype="bfloat16", skip_tokenizer_init=True, max_model_len=cfg["max_model_len"],
              max_num_seqs=1, enable_prefix_caching=False, seed=0)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    prefill = cfg["phase"] == "prefill"
    n_out = 1 if prefill else 1 + cfg["warmup"] + cfg["tokens"]
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True, detokenize=False)
    stamps, ids = [time.perf_counter()], []
    engine.add_request("bench", {"prompt_token_ids": list(cfg["prompt_ids"])}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = list(out.outputs[0].token_ids)
            if len(got) > len(ids):
                stamps += [time.perf_counter()] * (len(got) - len(ids))  # (one token a step at a batch of one)
                ids = got
    res = {"load_s": load_s, "output_ids": ids, "vllm_version": vllm.__version__, "peak_rss_bytes": _vm_hwm()}
    if prefill:
        res["ttft_s"] = stamps[1] - stamps[0]
    else:
        timed = stamps[2 + cfg["warmup"]:]  # after the first token (the prompt's) and the warm-up tokens
        res["tpot_s"] = [b - a for a, b in zip(stamps[1 + cfg["warmup"]:], timed)]
    print("RESULT " + json.dumps(res), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _vm_hwm() -> int:
    """This process's peak resident set (/proc/self/status VmHWM, kB); 0 where it cannot be read."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
