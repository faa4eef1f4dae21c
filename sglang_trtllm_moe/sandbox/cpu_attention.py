"""A CPU stand-in of the test sandbox for numerics, not for CUDA: SGLang's `torch_native` attention made
batch-invariant (standins.py installs it with the others; docs/TESTING.md's stand-in table)."""

from __future__ import annotations


def batch_invariant_cpu_attention() -> None:
    """SGLang's `torch_native` attention calls torch's `scaled_dot_product_attention` once per request: a prefill of
    n queries, a decode of one. torch's CPU flash-attention kernel blocks those differently and its small-M GEMMs
    round the last bits differently on some CPUs (measured on the CI box, an AVX2 AMD EPYC with torch 2.13's MKL:
    Qwen3-MoE NVFP4's logits of a decode step and of the same tokens prefilled differ by up to 0.18), so a token
    comparison across batch shapes would depend on the machine (docs/TESTING.md "Exact comparisons"). The stand-in
    runs the same call under torch's own MATH backend (`torch.nn.attention.sdpa_kernel`), whose bf16 products do not
    depend on the number of queries; SGLang's masking, GQA and scaling arguments pass through unchanged."""
    try:
        from sglang.srt.layers.attention import torch_native_backend as tnb
    except ImportError:
        return
    sdpa = getattr(tnb, "scaled_dot_product_attention", None)
    if sdpa is None or getattr(sdpa, "_trtllm_moe_math", False):
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def scaled_dot_product_attention(*args, **kwargs):
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa(*args, **kwargs)

    scaled_dot_product_attention._trtllm_moe_math = True  # type: ignore[attr-defined]
    tnb.scaled_dot_product_attention = scaled_dot_product_attention
