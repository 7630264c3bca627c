"""The GPU tests of the connector's worker side run on a device without vLLM, over stand-ins for the
few vLLM classes the worker's modules import (test_worker_cuda._stand_in_vllm). Those tests never run
here, so this checks on CPU that the stand-ins still cover every vLLM name the worker imports: a new
import would otherwise break the GPU tests only on the device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROGRAM = f"""
import importlib.abc, importlib.util, sys

class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vLLM is hidden in this process")
        return None

sys.meta_path.insert(0, NoVllm())
spec = importlib.util.spec_from_file_location("worker_cuda", {str(TESTS / "test_worker_cuda.py")!r})
module = sys.modules["worker_cuda"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._stand_in_vllm()
import umbp.vllm.worker, umbp.vllm.metadata  # what make_worker() imports
print("imported")
"""


def test_stand_ins_cover_the_worker_imports():
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]
