"""`--dist loadfile` with three changes (Makefile's `make test`): files that share a costly session fixture run as
one work unit, the longest units are handed out first, and a worker that dies neither hangs the run nor takes
its replacement down with it (see SharedFixtureFileScheduling's methods).

loadfile sends each test file to one worker, so a session fixture is built once per worker that runs a file
using it. The disaggregation suites' process cluster (six `recap serve`/`recap proxy` processes,
tests/disagg/conftest.py) and the local Ray cluster (tests/cluster/conftest.py) were each started twice, on
both workers at once on the 2-core CI box. xdist hands out units by test count, so a file of a few long tests
(the Triton engine suites, 30-60 s a test under the interpreter) came last and bounded the wall time alone.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

# file -> its work unit, for the files whose tests share a process cluster (one worker starts each cluster once)
SHARED_UNITS = {
    **dict.fromkeys(("tests/disagg/test_hostile_proxy.py", "tests/disagg/test_serving.py",
                     "tests/disagg/test_trust_serving.py"), "disagg process cluster"),
    **dict.fromkeys(("tests/cluster/test_ray_serve.py", "tests/cluster/test_ray_disagg.py"), "ray serve cluster"),
}  # fmt: skip
# Units handed out before the rest (each takes minutes on the loaded CI box); one not collected is passed over.
# The two clusters' units are not handed out together: each starts several processes on a 2-core box.
FIRST = ("disagg process cluster", "tests/engine/test_equivalence.py", "ray serve cluster",
         "tests/engine/test_triton_backend.py", "tests/engine/test_cuda_graph_backend.py")  # fmt: skip


class SharedFixtureFileScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return SHARED_UNITS.get(path, path)

    def remove_node(self, node: WorkerController) -> str | None:
        """The test a worker died on is reported failed and not run again (xdist 3.8.0 reruns it: a test that
        kills its interpreter then kills each replacement until the restarts run out; pytest-xdist PR 1371)."""
        workload = self.assigned_work[node]
        crashed = next((t for tests in workload.values() for t, done in tests.items() if not done), None)
        if crashed is None:
            return super().remove_node(node)  # a worker shut down with nothing pending
        for tests in workload.values():
            if crashed in tests:
                tests[crashed] = True
        super().remove_node(node)  # the rest of its work goes back on the queue
        return crashed

    def _assign_work_unit(self, node: WorkerController) -> None:
        # xdist 3.8.0 puts a crashed worker's whole workload back on the queue, its finished files too: sent as
        # an empty unit, such a file never completes, and the run hangs at its end with idle workers
        # (pytest-xdist issue 1378). They are dropped here.
        for unit in [u for u, tests in self.workqueue.items() if all(tests.values())]:
            del self.workqueue[unit]
        if not self.workqueue:
            return
        for unit in reversed(FIRST):
            if unit in self.workqueue:
                self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)
