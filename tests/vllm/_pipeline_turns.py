"""Serve one 840-token prompt TURNS times on a real vLLM engine with two pipeline stages and umbp embedded;
print a JSON line with the turns and the scheduler side's counters.

usage: python _pipeline_turns.py ARCH MODEL_DIR LAYER_PARTITION EXTRA_CONFIG_JSON TURNS

Between turns vLLM's local prefix cache is dropped, so a later turn's prefix can only come from umbp (one
turn per process: from what an earlier process left on the SSD tier). The stages' layouts reach the
scheduler through vLLM's start-up handshake (umbp.vllm.stages), so the first request is cached too. Runs
as its own process because vLLM starts the stage workers with ``spawn``, which re-imports ``__main__``.
"""

import json
import os
import sys


def main() -> None:
    arch, model_dir, partition = sys.argv[1], sys.argv[2], sys.argv[3]
    extra, turns = json.loads(sys.argv[4]), int(sys.argv[5])
    os.environ["VLLM_PP_LAYER_PARTITION"] = partition
    # one core per stage worker: vLLM-CPU cannot pick them itself on a single NUMA node
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[-1]}")
    from umbp.tools import vllm_harness as H
    from umbp.tools.demo import umbp_scheduler

    llm = H.make_llm_for_arch(
        arch,
        model_dir,
        kv_transfer_config=H.umbp_transfer(extra),
        prefix_match_unit=16,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        # vLLM-CPU allocates a later stage's input buffers only in its compile warm-up
        enforce_eager=False,
    )
    try:
        prompt = H.random_prompt(840, seed=7)
        done = []
        for i in range(turns):
            if i:
                H.drop_gpu_prefix_cache(llm)
            done.append(H.run_prompt(llm, prompt))
        sched = umbp_scheduler(llm)
        result = {
            "turns": [
                {"tokens": t.token_ids, "logprobs": t.logprobs, "cached": t.num_cached_tokens} for t in done
            ],
            "totals": dict(sched.totals),
            "slot_bytes": list(sched.slot_bytes),
            "stage0_object_bytes": list(sched.layout.object_bytes),
        }
    finally:
        H.shutdown_llm(llm)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
