"""Helpers every `umbp bench` command shares: a progress bar, a GC-quiet timer, byte-size labels."""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

KiB, MiB = 1 << 10, 1 << 20


class Progress:
    """tqdm when installed (it is not a core dependency), else a one-line stderr bar."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self._label = total, 0, ""
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, file=sys.stderr, unit="step", leave=False, dynamic_ncols=True)

    def step(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_description(label, refresh=False)
            self._bar.update(1)
            return
        filled = int(30 * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<24}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


def timed(fn: Callable[[], Any]) -> float:
    gc_was_enabled = gc.isenabled()
    gc.disable()  # applies to pool and baseline alike; a GC pause would only add noise
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def spread(values: Sequence[float]) -> str:
    """'lowest-highest' of per-repetition ratios: a median near a target means little when they span 0.2."""
    return f"{min(values):.2f}-{max(values):.2f}"


def check_output(tool: str, path: str | Path, directory: bool = False) -> None:
    """Fail at once, with one clear message, when a tool's --out cannot be written: before minutes of
    benchmarking, not after. `directory`: --out names a folder to write into rather than a file."""
    if not directory and Path(path).expanduser().is_dir():
        raise SystemExit(
            f"{tool}: cannot write --out {path}: it is a folder; pass --out with a file name (e.g. "
            f"{Path(path) / 'result.json'})"
        )
    usable_folder(tool, "--out", path, None if directory else Path(path).expanduser().parent)


def usable_folder(tool: str, option: str, path: str | Path, folder: Path | None = None) -> Path:
    """`folder` (default: `path` expanded), made if missing and written into once; else one clear error
    naming `option` (a file where a folder should be, no permission, a read-only disk)."""
    folder = folder if folder is not None else Path(path).expanduser()
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise SystemExit(
            f"{tool}: cannot write {option} {path}: {blocker} is a file, not a folder; pass {option} with "
            "a path in a writable folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise SystemExit(
            f"{tool}: cannot write {option} {path}: {exc.strerror or exc}; pass {option} with a path in a "
            "writable folder"
        ) from None
    return folder


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux), None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(tool: str, need: int, what: str) -> None:
    """Fail at once when a run would allocate more than the machine has free (`need` bytes for `what`),
    with one message naming the option to change, instead of a MemoryError or the OOM killer."""
    free = available_memory()
    if free is not None and need > free:
        raise SystemExit(f"{tool}: {what} needs {human(need)} of memory; {human(free)} is available")


def write_json(path: str | Path, payload: Any, indent: int = 2) -> Path:
    """A tool's JSON result, its folder made first; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=indent) + "\n")
    return out
