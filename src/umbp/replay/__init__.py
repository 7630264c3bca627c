"""`umbp replay`: agentic multi-turn traces through vLLM 0.32's real Scheduler, with umbp's scheduler-side
connector and simulated workers (no model, CPU only), measured against an oracle.

Why a simulation: the deployment's "Kimi K3 1P1D at concurrency 70" figure needs a GPU cluster to measure for
real; what umbp controls (which boundaries it can restore, how many bytes that costs) depends only on the
scheduler's decisions, which run unchanged here. See docs/replay.md.

* :mod:`umbp.replay.deployments`: the KV-cache layout config (Kimi-K3-like, Granite-4.0-H, or a JSON file);
* :mod:`umbp.replay.trace`: the JSONL trace format (and Mooncake-style ``hash_ids`` lines);
* :mod:`umbp.replay.generate`: a synthetic agentic generator, deterministic for a given --seed;
* :mod:`umbp.replay.engine`, :mod:`umbp.replay.simworker`, :mod:`umbp.replay.oracle`,
  :mod:`umbp.replay.driver`: the replay itself (these import vLLM);
* :mod:`umbp.replay.report`: tables, JSON and plots;
* :mod:`umbp.replay.offloading`, :mod:`umbp.replay.peer`: vLLM's own OffloadingConnector as a peer row
  (``--peers``; its scheduler side real, its copy step simulated with the same delay model).

Only ``deployments``, ``trace``, ``generate`` and ``report`` are importable without vLLM.
"""
