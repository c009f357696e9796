"""Triton kernels: the GPU counterparts of recap's torch reference kernels (docs/gpu.md).

Each module here holds kernels with the signature and the metadata contract of the reference op it
replaces (chunk ends, destination slots, the positions written into `slot_positions`, PAD_SLOT_ID rows
skipped), so a kernel set can swap one for the other (DESIGN invariant 10). Imported lazily: recap without
triton stays CPU-only. On a machine without a GPU the tests run these kernels under Triton's interpreter
(TRITON_INTERPRET=1, fp32 CPU tensors).
"""
