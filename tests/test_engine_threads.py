"""Torch work an engine runs off its event loop leaves the trainer's OpenMP threads spinning, not sleeping."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# # After one torch op off the loop, with the loop still running, the main thread runs a layer's matmul and activation
# back to back (a training step's rhythm) and the script prints how often the process's threads slept and woke
# meanwhile (voluntary context switches), then how many threads it has. fp32: the sleeps are OpenMP's whatever the
# dtype, and bf16 matmuls are 50x slower on CPUs without AVX512-BF16 (the test took 300 s there).
_SCRIPT = """
import asyncio, os, resource, sys
import torch
from generators.engines.threads import torch_in_thread

async def main():
    torch.set_num_threads(os.cpu_count())
    big = torch.randn(4_000_000)
    run = torch_in_thread if sys.argv[1] == "torch_in_thread" else asyncio.to_thread
    await run(lambda: big.to(torch.bfloat16).sum())
    x, w = torch.randn(300, 576), torch.randn(576, 1536)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(int(sys.argv[2])):
        (x @ w).relu_()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before, len(os.listdir("/proc/self/task")))

asyncio.run(main())
"""


def _sleeps_and_threads(way: str, matmuls: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, way, str(matmuls)], capture_output=True, text=True,
                         timeout=300, check=True)
    sleeps, threads = out.stdout.split()[-2:]
    return int(sleeps), int(threads)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch's main thread has no OpenMP team to slow")
def test_torch_work_off_the_loop_does_not_make_the_main_threads_openmp_team_sleep():
    # asyncio.to_thread's pool thread keeps the OpenMP team the op gave it; libgomp then counts more threads than
    # cores and the main team's idle threads sleep after a thousandth of their spin (the control shows it happens
    # here). torch_in_thread's thread ends with the op, and its team with it. The sleeps are the symptom, checked
    # on the control only: a loaded machine (the other test worker) makes any team sleep now and then, 300-550
    # times here with both cores busy against 0 idle, the control's 3,000 either way. The team left alive is the
    # cause, and counting threads does not depend on the load.
    pooled_sleeps, pooled_threads = _sleeps_and_threads("to_thread", 1000)
    _, fresh_threads = _sleeps_and_threads("torch_in_thread", 1)  # one matmul starts the main thread's team
    assert pooled_sleeps >= 500, f"the control did not slow: {pooled_sleeps} sleeps"
    # the pool thread, and the team it keeps: a thread per other core, at least one
    assert pooled_threads - fresh_threads >= 2, (pooled_threads, fresh_threads)
