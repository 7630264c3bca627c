"""Run one turn of a prompt in a fresh process with umbp embedded; print a JSON line with the result.

Used by the cross-process tests: a restarted engine (new process, empty DRAM) must restore from the SSD
tier (or the shared tier) what an earlier process computed.
usage: python _one_turn.py ARCH MODEL_DIR EXTRA_CONFIG_JSON
"""

import json
import sys

from umbp.tools import vllm_harness as H
from umbp.tools.demo import umbp_scheduler


def main() -> None:
    arch, model_dir, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    transfer = {"kv_connector": "UMBPConnector", "kv_connector_module_path": "umbp.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = H.make_llm_for_arch(arch, model_dir, kv_transfer_config=transfer)
    turn = H.run_prompt(llm, H.random_prompt(840, seed=7), max_tokens=8)
    totals = dict(umbp_scheduler(llm).totals)
    H.shutdown_llm(llm)
    print("RESULT " + json.dumps({"tokens": turn.token_ids, "logprobs": turn.logprobs,
                                  "cached": turn.num_cached_tokens, "totals": totals}))


if __name__ == "__main__":
    main()
