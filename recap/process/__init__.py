"""Process tuning and introspection: the heap's trim policy (heap.py), one OpenMP pool per process (openmp.py),
and a census of the engine's live records for leak hunting (census.py)."""
