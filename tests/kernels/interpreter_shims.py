"""Shims for triton 3.6's CPU interpreter, shared by the kernel tests (the compiled GPU
kernels are unaffected). Installed once per process, all three together."""

from __future__ import annotations

import numpy as np
import torch


def install_interpreter_shims() -> None:
    """Work around three triton 3.6 interpreter gaps; the compiled GPU kernel is unaffected.

    1. Scalars are 1-element arrays converted with ``int(array)``, which numpy >= 2.4
       rejects, so ``range()`` bounds computed from program_id/loads fail.
    2. ``tl.dot`` on bf16 operands multiplies their raw uint16 storage; widen to fp32
       first (exact), which is what the tensor cores compute with.
    """
    from triton.runtime import interpreter

    if getattr(interpreter, "_moeserve_shims", False):
        return
    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(handle):
        if handle.dtype.scalar != interpreter.tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), interpreter.tl.float32)

    original_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    # 3. Its fp32 -> fp8 cast drops the carry when rounding up (1.99 -> 1.0); the GPU's
    #    cvt.rn.satfinite is exact, so let torch narrow (round to nearest even).
    original_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if (
            dst_type.scalar != interpreter.tl.float8e4nv
            or src.dtype.scalar != interpreter.tl.float32
        ):
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        narrowed = (
            torch.from_numpy(src.data.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8)
        )
        return interpreter.TensorHandle(narrowed.numpy(), dst_type.scalar)

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    interpreter._moeserve_shims = True
