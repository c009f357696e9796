"""leave_threads_to_engine: the calling thread's OpenMP pool goes away and stays away, other threads keep theirs.

In child processes: OpenMP pools and thread counts are per process. A pool's workers are OS threads, so the
checks count /proc/self/task. The speed it buys (a second pool made each parallel region of the engine
thread sleep and wake) is measured in docs/performance.md, not here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recap.process.openmp import _runtime

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc"),
    pytest.mark.skipif(_runtime() is None, reason="no OpenMP runtime with omp_pause_resource_all loaded"),
]

CHILD = textwrap.dedent("""
    import os, threading, torch
    from recap.process.openmp import leave_threads_to_engine
    tasks = lambda: len(os.listdir("/proc/self/task"))
    torch.set_num_threads(2)
    a = torch.randn(384, 512)
    def work():  # element-wise (ATen's OpenMP loops), exp and matmul (MKL's own thread count)
        for _ in range(3):
            (a * a).exp_().sum()
            a @ a.T
    work()
    with_pool = tasks()
    ok = leave_threads_to_engine()
    after = tasks()
    work()
    print("main", ok, with_pool, after, tasks(), torch.get_num_threads())
    def engine():
        before = tasks()
        work()
        print("engine", torch.get_num_threads(), before, tasks())
    t = threading.Thread(target=engine)
    t.start()
    t.join()
""")


def test_the_pool_goes_and_stays_gone_while_other_threads_keep_theirs() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True).stdout
    main, engine = (line.split() for line in out.strip().splitlines())
    ok, with_pool, after, after_work, main_threads = main[1], *map(int, main[2:])
    assert ok == "True"
    assert after == with_pool - 1  # the pool's one worker exited
    assert after_work == after  # the main thread's later torch work built no new pool
    assert main_threads == 1
    threads, before, during = map(int, engine[1:])
    assert threads == 2  # torch's process-wide count still reaches other threads
    assert during == before + 1  # ... which build their own pool (one worker besides themselves)


ENGINE_CHILD = textwrap.dedent("""
    import asyncio, torch
    from pathlib import Path
    from recap.engine.async_engine import AsyncEngine
    from recap.engine.config import EngineConfig
    from recap.engine.llm_engine import LLMEngine
    from recap.model import default_model
    from recap.model.testing import make_tiny_checkpoint
    from recap.sampling_params import SamplingParams
    path = make_tiny_checkpoint("bamba", Path({root!r}), vocab_size=default_model.VOCAB_SIZE)
    default_model.save_tokenizer(path, default_model.SEED)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), num_threads=2)))
    async def main():
        prepared = engine.prepare(list(range(5, 300)), SamplingParams(max_tokens=3, temperature=0))
        async for _ in engine.generate(prepared):
            pass
        return await engine.call(lambda e: torch.get_num_threads())
    inside = asyncio.run(main())
    print(torch.get_num_threads(), inside)
    engine.shutdown()
""")


def test_async_engine_keeps_the_threads_on_its_engine_thread(tmp_path: Path) -> None:
    """The thread that built and started the engine runs serially; the engine thread at num_threads."""
    code = ENGINE_CHILD.format(root=str(tmp_path / "bamba"))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    outside, inside = map(int, out.split()[-2:])
    assert (outside, inside) == (1, 2)
