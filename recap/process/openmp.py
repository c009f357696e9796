"""The OpenMP runtime's thread pools: the engine thread should be the only thread that holds one.

torch, oneDNN and recap's native kernels share one OpenMP runtime (libgomp in torch's CPU wheels). It gives
every thread that starts a parallel region its own pool of workers, kept until that thread exits, and when
the pools' threads outnumber the CPUs every worker stops spinning between regions (libgomp's throttled spin
count: ~1,000 spins instead of ~300,000) and sleeps, so each parallel region pays a futex wake-up.
`recap serve` loads the model on its main thread (one pool) and steps it on the engine thread (a second):
at 2 threads on this 2-core machine a 48x1536 multiply took 27-29 us on the engine thread against 5 us on
the main thread, and a 40-token multi-turn prefill of the 163M hybrid 210-240 ms against 145-170 ms.
`omp_pause_resource_all` (OpenMP 5.0) frees the calling thread's pool; capping that thread at one thread
afterwards, for OpenMP and for MKL (whose own count is process-wide: torch's exp and matmul went through
MKL's 2-thread regions with OpenMP's count at 1), keeps it from building another; its later torch ops run
serially.
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp", "libomp")


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "/" in line and ".so" in line})
    except OSError:
        return []


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process already loaded (torch's), or None; never loads another one."""
    for path in _loaded_libraries():
        if path.rsplit("/", 1)[-1].startswith(_RUNTIMES):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            except (OSError, AttributeError):
                continue
            return lib
    return None


@functools.cache
def _mkl_set_local() -> ctypes._CFuncPtr | None:
    """MKL's per-thread thread count setter (its C interface: the lower-case names are the Fortran one, taking
    a pointer), from whichever loaded library exports it (torch links MKL into libtorch_cpu), or None."""
    for path in _loaded_libraries():
        name = path.rsplit("/", 1)[-1]
        if "torch" in name or "mkl" in name:
            try:
                fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def leave_threads_to_engine() -> bool:
    """Free the calling thread's OpenMP pool and run its later parallel regions on one thread, so that the
    engine thread's pool is the only one. For the thread that loaded the model and serves requests, not for
    the engine thread. False where no OpenMP runtime with these calls is loaded (nothing changed)."""
    lib = _runtime()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    mkl = _mkl_set_local()
    if mkl is not None:
        mkl(1)
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
