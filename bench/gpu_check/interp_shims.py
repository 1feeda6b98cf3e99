"""Two fixes to Triton 3.6's CPU interpreter (TRITON_INTERPRET=1), applied only in `--cpu` mode.

The interpreter is the test harness here, not the thing tested: on a GPU the carried kernel is
compiled by Triton and none of this is used. Both were found running the carried
extend_attention.py under the interpreter on this project's CPU machine (triton 3.6.0, numpy 2.4):

1. A scalar loaded with tl.load (e.g. `kv_indptr[seq + 1] - kv_indptr[seq]`) is a 1-element
   array; the interpreter turns it into a Python int for `range()` with `int(array)`, which numpy
   >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"). Fixed with
   `.item()`.
2. The interpreter stores bfloat16 as raw uint16 bits and its tl.dot multiplies those bits as
   integers (garbage, ~1e8). Fixed by widening bf16 operands to float32 (exact) before the matmul,
   which is what a GPU's bf16 MMA with float32 accumulation computes.
"""

from __future__ import annotations

SHIMS = [
    "interpreter tensor __index__ uses .item() (numpy >= 2.4 refuses int() of a 1-element array)",
    "interpreter tl.dot widens bfloat16 operands to float32 (it multiplied their raw uint16 bits)",
]


def apply() -> list[str]:
    """Patch triton.runtime.interpreter in this process; returns SHIMS (what was patched)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    if getattr(ti, "_fleetctl_shims", False):
        return SHIMS
    patch_tensor = ti._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    ti._patch_lang_tensor = _patch_lang_tensor

    builder = ti.InterpreterBuilder
    create_dot = builder.create_dot

    def _widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = ti._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return ti.TensorHandle(data, tl.float32)
        return h

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot_bf16
    ti._fleetctl_shims = True
    return SHIMS
