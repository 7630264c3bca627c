"""Run one turn of a prompt in a fresh process with umbp embedded; print a JSON line with the result.

Used by the cross-process tests: a restarted engine (new process, empty DRAM) must restore from the SSD
tier (or the shared tier) what an earlier process computed.
usage: python _one_turn.py ARCH MODEL_DIR EXTRA_CONFIG_JSON [gate]

With `gate`, every SSD-tier read blocks until the engine has stepped 3 times while it was blocked (or 60 s
pass): a load that ran on the engine's step would never see those steps. The result then reports how many
steps ran while a read was blocked.
"""

import json
import sys
import threading

from umbp.tools.demo_restart import one_turn


def gate_tier_reads() -> dict:
    """Block SSD-tier reads until 3 engine steps ran while they were blocked (the engine is in-process)."""
    from umbp.pool.ssd.tier import SsdTier
    from umbp.vllm.worker import WorkerSide

    state = {"blocked": 0, "steps_while_reading": 0, "open": threading.Event()}
    get_into, take = SsdTier.get_into, WorkerSide.take_transfer_results

    def slow_get_into(self, keys, buffers):
        state["blocked"] += 1
        state["open"].wait(60)
        state["blocked"] -= 1
        return get_into(self, keys, buffers)

    def counting_take(self):
        if state["blocked"]:
            state["steps_while_reading"] += 1
            if state["steps_while_reading"] >= 3:
                state["open"].set()
        return take(self)

    SsdTier.get_into, WorkerSide.take_transfer_results = slow_get_into, counting_take
    return state


def main() -> None:
    arch, model_dir, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    gate = gate_tier_reads() if sys.argv[4:] == ["gate"] else None
    result = one_turn({"arch": arch, "model_dir": model_dir, "extra": extra, "prompt_tokens": 840, "seed": 7})
    result["steps_while_reading"] = gate["steps_while_reading"] if gate else None
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
