"""Run a helper script of this folder in its own process and read the JSON it prints on a "RESULT " line.

Engines that must not share this process (a restarted engine, vLLM's spawned stage workers) run this way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def script_result(name: str, *args: str, timeout_s: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / name), *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])
