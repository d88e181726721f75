"""A judge endpoint on a cluster node for tests/faults.py: the tiny model on a vLLM server listening on every
interface at ``PORT``, serving ``judge``, until it is killed; its log at ``LOG`` (a node's cache is read-only).

    python tests/judge_server.py PORT LOG
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tiny import tiny_model_dir

from generators import VLLMEngine
from generators.engines.managed import ServerOptions


async def main(port: int, log: Path) -> None:
    options = ServerOptions(served_model_name="judge", host="0.0.0.0", port=port, log_path=log)
    async with VLLMEngine(tiny_model_dir(), options, kv_cache_gib=1) as engine:
        print(f"judge at {engine.base_url}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2])))
