"""The triton 3.6 interpreter narrows fp32 -> bf16 by truncating the mantissa; the GPU's cvt.rn
rounds to nearest even (as torch does). This shim lets torch do those casts so that kernel
tests compare the kernel's arithmetic, not the interpreter's rounding. GPU code is
unaffected; installing it twice is harmless.
(fp16 narrowing already rounds there: numpy's astype.)"""

from __future__ import annotations

import numpy as np
import torch


def install_bf16_rounding_shim() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_moeserve_bf16_rounding", False):
        return
    tl = interpreter.tl
    original = interpreter.InterpreterBuilder.create_fp_trunc

    def create_fp_trunc(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16 or src.dtype.scalar != tl.float32:
            return original(self, src, dst_type)
        narrowed = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        data = narrowed.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(data, dst_type.scalar)

    interpreter.InterpreterBuilder.create_fp_trunc = create_fp_trunc
    interpreter._moeserve_bf16_rounding = True
