"""Test-env only: let CUDA-built torchvision import beside CPU torch (installed into CI venvs by ci/make-env).

PyPI's torchvision is a CUDA build whose _C.so cannot load against CPU torch; its meta registrations then fail on
`torchvision::nms` and every `sglang.srt.layers.*` import dies (SGLang imports torchvision unconditionally, though
it only needs pure-Python parts). Defining the two op schemas before torchvision loads is enough. A .pth file
installs this finder at interpreter start-up so every process of the env — pytest, `doctor`, SGLang's own
subprocesses — sees the same SGLang a GPU box would; torch is imported only when torchvision is.
"""

import sys


class _TorchvisionOpsFirst:
    done = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torchvision" and not cls.done:
            cls.done = True
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                try:
                    lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                except RuntimeError:
                    pass
            cls._lib = lib  # keep the fragment alive
        return None


sys.meta_path.insert(0, _TorchvisionOpsFirst)
