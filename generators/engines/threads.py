"""Torch work off the event loop, on threads that end with it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


async def torch_in_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """Await ``fn(*args)`` run on a thread of its own, which ends when ``fn`` returns.

    Not ``asyncio.to_thread``: its pool threads live on, and a torch op on one gives that thread an OpenMP team of
    its own. While it lives, libgomp counts more threads than cores and lets every team's idle threads spin a
    thousandth as long before they sleep, so the trainer's updates slept and woke ~35,000 times each and took 20-30%
    longer after the first weight sync had staged its tensors on a pool thread. A thread that ends frees its team.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envkit-torch")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
    finally:
        pool.shutdown(wait=False)
