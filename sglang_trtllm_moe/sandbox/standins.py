"""The CPU stand-ins: SGLang's own server, Engine and model classes on a box without a GPU, through the plugin's
path — what the sandbox's activation (`activation.py`, run in every process SGLang starts when both test-only
switches are set: SGLANG_TRTLLM_MOE_EMULATE=1 with SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100) installs besides the faked
SM100.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) needs `sgl_kernel`, which has no CPU build on PyPI, so on such a box
SGLang runs with neither CUDA nor its CPU engine and takes its plain-PyTorch fallbacks. A few places still reach a
CUDA-only kernel or pick a branch the GPU server never takes; each stand-in below replaces exactly one of them with
the same math in torch, or selects the GPU server's own branch. Nothing here changes SGLang's logic: model code,
loaders, weight updaters, routing decisions and the plugin run unchanged. docs/TESTING.md lists every stand-in with
the SGLang file it is needed for and why it is the same math. `apply()` installs them in this process (idempotent;
nothing where CUDA is present); importing this module imports neither torch nor SGLang.

`spawn_path()` is the older way to reach spawned processes, kept for tests that want the stand-ins without the
faked platform: a directory to put on PYTHONPATH holding a tiny distribution whose `sglang.srt.plugins` entry point
calls `plugin_entry()` (the stand-ins; and the whole sandbox when both switches are set). Nothing is active in a
normal installation: the distribution exists only in that temporary directory.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

from .cpu_attention import batch_invariant_cpu_attention

_APPLIED: dict[str, object] = {}


def torchvision_op_schemas() -> None:
    """PyPI's torchvision is a CUDA build whose _C.so cannot load against CPU torch; its meta registrations then fail
    on `torchvision::nms`. SGLang imports torchvision unconditionally (configs -> internvl_utils) but needs only its
    pure-Python parts: defining the two op schemas is enough (no kernel is registered, none is ever called)."""
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # the real torchvision ops are already registered
    _APPLIED["_tv_lib"] = lib  # keep the library object alive


def vllm_custom_ops_import_stub() -> None:
    """`layers/rotary_embedding/base.py` (RotaryEmbedding.__init__) imports `vllm._custom_ops.rotary_embedding` when
    the platform is neither CUDA, HIP nor SGLang's CPU engine, and stores it as `fallback_rotary_embedding`. That
    function is called only from `forward_cuda`; on this box the op dispatches to `forward_native` (torch). So an
    import-only module is enough; calling it raises, so a use would be seen, not silently replaced."""
    if "vllm._custom_ops" in sys.modules:
        return
    try:
        importlib.import_module("vllm._custom_ops")  # a real vLLM is installed: nothing to stand in for
        return
    except ImportError:
        pass

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError(
            "sglang-trtllm-moe CPU stand-in: vllm._custom_ops.rotary_embedding is import-only "
            "(SGLang's CUDA branch called it on a CPU box)"
        )

    pkg = sys.modules.get("vllm") or types.ModuleType("vllm")
    pkg.__path__ = getattr(pkg, "__path__", [])
    vars(pkg)["__sglang_trtllm_moe_standin__"] = True
    ops = types.ModuleType("vllm._custom_ops")
    vars(ops).update(rotary_embedding=rotary_embedding, __sglang_trtllm_moe_standin__=True)
    vars(pkg)["_custom_ops"] = ops
    sys.modules.setdefault("vllm", pkg)
    sys.modules["vllm._custom_ops"] = ops


_KVCACHEIO_STUB = '''"""sglang-trtllm-moe CPU stand-in, import-only (sandbox/standins.py)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"sglang-trtllm-moe CPU stand-in: sgl_kernel.kvcacheio.{name} is import-only (the host KV cache's "
            "CUDA transfer kernel was called on a CPU box)"
        )

    return kernel
'''


def sgl_kernel_kvcacheio_import_stub() -> None:
    """SGLang 0.5.11-0.5.12 import `sgl_kernel.kvcacheio` (the hierarchical host KV cache's CUDA transfer kernels)
    at module level of `mem_cache/memory_pool_host.py` on every platform but NPU / XPU / MPS, and the scheduler
    imports that module (0.5.13 guards it with is_cuda / is_hip); sgl_kernel has no CPU build on PyPI. The kernels
    run only with --enable-hierarchical-cache, never here: an import-only package is enough, and calling one raises.

    A directory on sys.path, not a sys.modules entry: the Engine's scheduler is a spawned process that imports
    the scheduler module while it unpickles its target, before SGLang's load_plugins() (so before register())
    could run there; multiprocessing gives the child the parent's sys.path first. The empty `sgl_kernel` package
    answers every other probe as a missing one does (`from sgl_kernel import x` and `sgl_kernel.allreduce` raise
    ImportError; `torch.ops.sgl_kernel` has no op)."""
    import importlib.util
    import tempfile

    from .releases import HOST_KV_POOL_IMPORTS_SGL_KERNEL

    if not HOST_KV_POOL_IMPORTS_SGL_KERNEL.present() or importlib.util.find_spec("sgl_kernel") is not None:
        return
    root = os.path.join(tempfile.gettempdir(), f"sglang-trtllm-moe-sgl-kernel-stub-{os.getuid()}")
    pkg = os.path.join(root, "sgl_kernel")
    os.makedirs(pkg, exist_ok=True)
    init = '"""sglang-trtllm-moe CPU stand-in: import-only."""\n'
    for name, text in (("__init__.py", init), ("kvcacheio.py", _KVCACHEIO_STUB)):
        path = os.path.join(pkg, name)
        if not os.path.exists(path) or open(path).read() != text:
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
    if root not in sys.path:
        sys.path.insert(0, root)
    importlib.invalidate_caches()


def nvfp4_placeholder_swizzle_on_cpu() -> None:
    """Up to 0.5.19 ModelOpt NVFP4 `create_weights` calls `quantization.utils.swizzle_blockscale` for a shape-only
    placeholder (`w13_blockscale_swizzled`; 0.5.16+ skip it on flashinfer_trtllm), and that function ends in
    `.contiguous().cuda()`, so no NVFP4 MoE layer can be built without a GPU. SGLang's own function is kept; only its
    `.cuda()` is a no-op for the duration of that call, and the name is rebound in every module that imported it."""
    import functools
    import unittest.mock

    import torch

    from .releases import SWIZZLE_MOVES_TO_CUDA

    if not SWIZZLE_MOVES_TO_CUDA.present():
        return
    import sglang.srt.layers.quantization.modelopt_quant  # noqa: F401  (binds the name first)
    from sglang.srt.layers.quantization import utils as qutils

    original = qutils.swizzle_blockscale
    if getattr(original, "_trtllm_moe_cpu", False):
        return

    @functools.wraps(original)
    def swizzle_blockscale(scale):
        with unittest.mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
            return original(scale)

    vars(swizzle_blockscale)["_trtllm_moe_cpu"] = True
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("sglang") and getattr(mod, "swizzle_blockscale", None) is original:
            vars(mod)["swizzle_blockscale"] = swizzle_blockscale


def cpu_mm_out_dtype() -> None:
    """`torch.mm(a, b, out_dtype=torch.float32)` (`aten::mm.dtype`) has no CPU kernel in torch 2.13; Nemotron-H's
    router calls it (`models/nemotron_h.py`, NemotronHMoE router logits: BF16 inputs, FP32 output). The CUDA kernel
    multiplies BF16 inputs with FP32 accumulation into an FP32 result; the stand-in upcasts the BF16 inputs to FP32
    (exact) and multiplies in FP32: the same products and accumulation type (summation order may differ)."""
    import torch

    try:
        torch.mm(
            torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16), out_dtype=torch.float32
        )
        return  # this torch has a CPU kernel
    except (NotImplementedError, RuntimeError):
        pass
    lib = torch.library.Library("aten", "IMPL")

    def mm_dtype(a, b, out_dtype):
        return torch.mm(a.to(out_dtype), b.to(out_dtype))

    lib.impl("mm.dtype", mm_dtype, "CPU")
    _APPLIED["_aten_lib"] = lib


def topk_bypass_on_cpu() -> None:
    """Routers bound to the flashinfer_trtllm runner (`TopK.bind_runner_backend`, layers/moe/topk.py) get output
    format BYPASSED: on a GPU, `TopK.forward_cuda` only packages the router logits and the fused kernel routes. On a
    box without CUDA the op dispatches to `forward_native`, which runs `select_experts` and hands the kernel a
    materialized routing instead (the per-tensor FP8 trtllm `apply` in modelopt_quant.py refuses it; other formats
    would route twice). The stand-in takes the GPU server's own branch — `forward_cuda` — for exactly those routers
    (BYPASSED output); every other TopK keeps SGLang's CPU dispatch. Before 0.5.23 routers have no bound backend:
    `forward_cuda` chooses BYPASSED itself when no output format is set and the process-wide runner backend is
    flashinfer_trtllm, and so does the stand-in."""
    from sglang.srt.layers.moe.topk import TopK

    native = TopK.forward_native
    if getattr(native, "_trtllm_moe_standin", False):
        return
    try:
        from sglang.srt.layers.moe.topk import TopKOutputFormat
    except ImportError:  # releases without bypassed TopK output: nothing to select
        return

    def forward_native(self, hidden_states, router_logits, *args, **kwargs):
        cfg = self.topk_config
        if kwargs.get("dynamic_expert_bias") is None:
            fmt = getattr(cfg, "output_format", None)
            if hasattr(cfg, "runner_backend"):  # 0.5.23: TopK.bind_runner_backend sets both
                backend = cfg.runner_backend
                bypassed = fmt == TopKOutputFormat.BYPASSED and backend is not None and backend.is_flashinfer_trtllm()
            else:  # before: forward_cuda picks BYPASSED from the process-wide backend when no format is set
                from sglang.srt.layers.moe.utils import get_moe_runner_backend

                bypassed = fmt is None and get_moe_runner_backend().is_flashinfer_trtllm()
            if bypassed:
                return self.forward_cuda(hidden_states, router_logits, *args, **kwargs)
        return native(self, hidden_states, router_logits, *args, **kwargs)

    vars(forward_native).update(_trtllm_moe_standin=True, __wrapped__=native)
    TopK.forward_native = forward_native


def deepseek_mla_on_torch_native() -> None:
    """DeepSeek's attention picks a forward method per attention backend (models/deepseek_common/
    attention_backend_handler.py, AttentionBackendRegistry); `torch_native` has no entry, so it falls back to the
    triton handler, which takes the MHA path for prefill. torch_native's extend reads K/V from the KV pool, and the
    MLA pool holds the compressed latent (kv_lora_rank + rope wide), so that MHA prefill fails (width 96 vs 160).
    The stand-in registers torch_native with SGLang's own MLA dispatch (`_dispatch_mla_subtype`, what the triton
    handler returns for decode): the weight-absorbed MLA form of the same attention, which torch_native supports."""
    try:
        from sglang.srt.models.deepseek_common import attention_backend_handler as h
    except ImportError:
        return
    if "torch_native" in h.AttentionBackendRegistry._handlers:
        return

    def handle_attention_torch_native(attn, forward_batch):
        return h._dispatch_mla_subtype(attn, forward_batch)

    h.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


def cpu_tensors_through_the_reduction_patch() -> None:
    """`utils/patch_torch.py` `monkey_patch_torch_reductions` (applied by `weight_sync.utils.update_weights`, verl's
    client helper, and by the WeightUpdater's tensor path) replaces torch's tensor reducer with one that rewrites the
    device index of a CUDA IPC handle (argument 6 of `rebuild_cuda_tensor`) into that GPU's uuid. A CPU tensor's
    reduction has no such argument (torch's `rebuild_tensor(cls, storage, metadata)`), so on a box without CUDA the
    patched reducer raises IndexError for every tensor. The stand-in hands tensors that are not on CUDA to torch's own
    reducer, unchanged; CUDA tensors keep SGLang's rewrite."""
    try:
        from sglang.srt.utils import patch_torch
    except ImportError:  # a release without the patch: nothing to stand in for
        return
    modified = getattr(patch_torch, "_reduce_tensor_modified", None)
    if modified is None or getattr(modified, "_trtllm_moe_standin", False):
        return
    import torch
    from torch.multiprocessing import reductions

    def _reduce_tensor_modified(*args, **kwargs):
        tensor = args[0] if args else kwargs.get("tensor")
        if isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
            return getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)(*args, **kwargs)
        return modified(*args, **kwargs)

    vars(_reduce_tensor_modified).update(_trtllm_moe_standin=True, __wrapped__=modified)
    patch_torch._reduce_tensor_modified = _reduce_tensor_modified  # read by monkey_patch_torch_reductions


def pageable_routed_experts_host_cache() -> None:
    """SGLang's routed-experts capturer (`--enable-return-routed-experts`) keeps its host copy of the captured ids in
    pinned memory: `torch.zeros(..., pin_memory=True)` in its host cache (state_capturer/base.py; 0.5.11:
    layers/moe/routed_experts_capturer.py) before 0.5.21, then an mmap'd buffer registered with `cudaHostRegister`
    (mem_cache/pool_host/common.py `_cuda_host_register`, which calls `torch.cuda.cudart()`). A CPU-only torch has
    neither, so such a server does not start. Pinning only lets a GPU copy into the buffer asynchronously; without a
    GPU every copy is a CPU copy. The stand-in keeps the buffer pageable — same shape, dtype, zeros, same bytes —:
    the host cache's module sees a `torch` whose `zeros` / `empty` drop `pin_memory`, and host registration is a
    no-op for buffers on a box without CUDA (every other use of those modules is unchanged)."""
    import torch

    for name in ("sglang.srt.state_capturer.base", "sglang.srt.layers.moe.routed_experts_capturer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if isinstance(getattr(module, "torch", None), _PageableTorch):
            continue
        if "pin_memory=True" in _source_of(module):
            module.torch = _PageableTorch()  # type: ignore[attr-defined]
    try:
        common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    except ImportError:
        return
    register = getattr(common, "_cuda_host_register", None)
    if register is None or getattr(register, "_trtllm_moe_standin", False):
        return

    def _cuda_host_register(buffer, *args, **kwargs):
        if torch.cuda.is_available():
            return register(buffer, *args, **kwargs)
        return None  # nothing to register with: the buffer stays pageable

    vars(_cuda_host_register).update(_trtllm_moe_standin=True, __wrapped__=register)
    common._cuda_host_register = _cuda_host_register  # type: ignore[attr-defined]


def flashinfer_nvfp4_quantize_on_cpu() -> None:
    """`--quantization nvfp4_online`: SGLang's online loader (`nvfp4_online.py` `_quantize_weight_nvfp4`) quantizes
    every BF16 expert with `flashinfer.nvfp4_quantize` (a function-local import, read at each call), every backend
    of which moves the input to CUDA. The stand-in (`nvfp4_quantizer.py`) computes the same bytes with the plugin's
    pure-torch quantizers for what SGLang asks of it, and raises NotImplementedError for anything else; a flashinfer
    that is not importable here leaves nothing to stand in for."""
    from .nvfp4_quantizer import route_flashinfer_quantizer

    route_flashinfer_quantizer(cuda=False)


def _source_of(module) -> str:
    import inspect

    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


class _PageableTorch(types.ModuleType):
    """`torch` as one SGLang module sees it in the sandbox: `zeros` / `empty` without `pin_memory` (see
    `pageable_routed_experts_host_cache`); every other name is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*args, pin_memory: bool = False, **kwargs):
        import torch

        return torch.zeros(*args, **kwargs)

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs):
        import torch

        return torch.empty(*args, **kwargs)


#: every stand-in, in the order apply() installs them: (name, function, needs sglang imported)
STANDINS = (
    ("torchvision op schemas", torchvision_op_schemas, False),
    ("vllm._custom_ops import stub", vllm_custom_ops_import_stub, False),
    ("sgl_kernel.kvcacheio import stub", sgl_kernel_kvcacheio_import_stub, False),
    ("CPU aten::mm.dtype", cpu_mm_out_dtype, False),
    ("TopK bypassed routing on CPU", topk_bypass_on_cpu, True),
    ("DeepSeek MLA on torch_native", deepseek_mla_on_torch_native, True),
    ("batch-invariant CPU attention", batch_invariant_cpu_attention, True),
    ("CPU tensors through SGLang's CUDA reduction patch", cpu_tensors_through_the_reduction_patch, True),
    ("pageable routed-experts host cache", pageable_routed_experts_host_cache, True),
    ("NVFP4 placeholder swizzle on CPU", nvfp4_placeholder_swizzle_on_cpu, True),
    ("flashinfer.nvfp4_quantize on CPU tensors", flashinfer_nvfp4_quantize_on_cpu, True),
)


def apply(with_sglang: bool = True) -> list[str]:
    """Install every stand-in (idempotent); only on a box without CUDA. Returns the names applied."""
    import torch

    if torch.cuda.is_available():
        return []
    done = []
    for name, fn, needs_sglang in STANDINS:
        if needs_sglang and not with_sglang:
            continue
        if not _APPLIED.get(name):
            fn()
            _APPLIED[name] = True
        done.append(name)
    return done


def plugin_entry() -> None:
    """`sglang.srt.plugins` entry point of the spawn-time distribution (see `spawn_path`): the stand-ins, and the
    whole sandbox (faked SM100) when both test-only switches are set — what the sandbox's activation does then."""
    from .activation import activate, requested_sm

    apply()
    sm = requested_sm()
    if sm is not None:
        activate(sm)


SPAWN_DIST = "sglang_trtllm_moe_cpu_standins"


def spawn_path(root: str | None = None) -> str:
    """A directory to prepend to PYTHONPATH so processes SGLang spawns apply the stand-ins: it holds only a
    `*.dist-info` declaring a `sglang.srt.plugins` entry point `cpu_standins = sglang_trtllm_moe.sandbox.standins:
    plugin_entry`. SGLang's `load_plugins()` (first thing in every scheduler / detokenizer process) runs it."""
    import tempfile

    root = root or tempfile.mkdtemp(prefix="sglang-trtllm-moe-standins-")
    info = os.path.join(root, f"{SPAWN_DIST}-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {SPAWN_DIST}\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\ncpu_standins = sglang_trtllm_moe.sandbox.standins:plugin_entry\n")
    return root


__all__ = [
    "SPAWN_DIST",
    "STANDINS",
    "apply",
    "cpu_mm_out_dtype",
    "cpu_tensors_through_the_reduction_patch",
    "deepseek_mla_on_torch_native",
    "flashinfer_nvfp4_quantize_on_cpu",
    "nvfp4_placeholder_swizzle_on_cpu",
    "pageable_routed_experts_host_cache",
    "plugin_entry",
    "sgl_kernel_kvcacheio_import_stub",
    "spawn_path",
    "topk_bypass_on_cpu",
    "torchvision_op_schemas",
    "vllm_custom_ops_import_stub",
]
