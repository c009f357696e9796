"""Reference torch kernels over packed variable-length batches (+ optional fast ops, same signatures)."""
