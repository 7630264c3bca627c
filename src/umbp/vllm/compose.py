"""What the UMBPConnector does so it composes with other connectors in vLLM 0.32's ``MultiConnector``.

The prefill instance of a P/D deployment runs ``MultiConnector[<P/D connector>, UMBPConnector]``. Two
things vLLM reads globally would otherwise break there (docs/vllm.md, "P/D deployments"):

* The load-failure policy. vLLM's Scheduler reads ``kv_load_failure_policy`` from the *outer*
  ``KVTransferConfig`` (the MultiConnector's), while each child connector is built with a shallow copy of
  the ``VllmConfig`` holding its own, fresh ``KVTransferConfig``. umbp's "a failed load is a recompute"
  written into its own copy would be ignored, and vLLM's default ``"fail"`` would turn a missing or corrupt
  page into a failed request. ``enclosing_transfer_configs`` finds the outer config so the connector can
  set the policy where vLLM reads it.
* Stats. ``MultiConnector.build_kv_connector_stats`` rebuilds each child's stats from a plain dict by
  looking the child's class name up in vLLM's connector registry; an out-of-tree connector loaded through
  ``kv_connector_module_path`` is not in it, so the stats logger raised "Connector 'UMBPConnector' is not
  registered". ``register_with_vllm`` registers it (on import of the connector, and from umbp's vLLM
  general plugin, umbp.vllm.plugin, so the API-server process, which never imports umbp itself, has it too).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("umbp.vllm")

CONNECTOR_NAME = "UMBPConnector"
MAX_FRAMES = 32  # how far up the stack a MultiConnector's constructor may be (vLLM 0.32: one frame)


def register_with_vllm() -> None:
    """Put "UMBPConnector" into vLLM's connector registry (lazily imported; idempotent; never raises: as a
    vLLM general plugin it runs in every vLLM process, including ones that do not use umbp)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # noqa: BLE001 - no (compatible) vLLM here: nothing to register with
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "umbp.vllm.connector", CONNECTOR_NAME)
    except ValueError:
        pass  # already registered (by an earlier import or the plugin)


def enclosing_transfer_configs(own: Any) -> list[Any]:
    """The ``KVTransferConfig`` of every MultiConnector whose constructor is building this connector.

    vLLM 0.32 passes a child no reference to its parent: the only place the parent's config is reachable is
    the parent's constructor frame (``MultiConnector.__init__(self, vllm_config, ...)``), which is on the
    stack while the child is built. Empty when this connector is not a MultiConnector child."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    except Exception:  # noqa: BLE001 - no MultiConnector in this vLLM
        return []
    found: list[Any] = []
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        if isinstance(frame.f_locals.get("self"), MultiConnector):
            outer = getattr(frame.f_locals.get("vllm_config"), "kv_transfer_config", None)
            if outer is not None and outer is not own and all(outer is not f for f in found):
                found.append(outer)
        frame = frame.f_back
    return found


def apply_load_failure_policy(own: Any, policy: str) -> None:
    """Write umbp's load-failure policy into its own transfer config and into every enclosing
    MultiConnector's, where vLLM's Scheduler reads it. The outer policy governs the sibling connectors'
    loads too: with "recompute" a failed P/D transfer is recomputed locally rather than failing the
    request, which is logged once so an operator who wanted "fail" can set umbp's 'load_failure_policy'."""
    own.kv_load_failure_policy = policy
    for outer in enclosing_transfer_configs(own):
        if outer.kv_load_failure_policy == policy:
            continue
        logger.warning(
            "umbp: setting the enclosing %s's kv_load_failure_policy from %r to %r: vLLM reads the policy "
            "there, and umbp's contract is that a failed load is a recompute. It applies to the other "
            "connectors' loads as well; set umbp's 'load_failure_policy' to keep %r.",
            outer.kv_connector,
            outer.kv_load_failure_policy,
            policy,
            outer.kv_load_failure_policy,
        )
        outer.kv_load_failure_policy = policy
