"""Weight sync without a server: the shared-memory transport's layout, the file a sync writes and the cleanup of
files whose owner died; the transport registry and the weight_sync config group; and the in-process HF engine taking
weights from memory as it takes them from disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from weights import model_tensors, perturbed_weights

from generators.engines.base import EngineError, SamplingParams
from generators.engines.hf import HFEngine
from generators.engines.transports.buckets import plan_buckets
from generators.engines.transports.shared import HEADER_BYTES, SHARED_PREFIX, SharedMemory, fits, shared_layout
from trainer.backends.hf_export import write_hf_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(1024, 600, generator=g), "a.bias": torch.randn(3, generator=g),
            "b.norm": torch.randn(7, generator=g), "c.steps": torch.arange(5)}


def test_the_file_holds_every_tensor_cast_aligned_and_stamped_last(tmp_path):
    tensors = _tensors()
    buckets = plan_buckets(tensors, cast="bfloat16")
    slots, size = shared_layout(buckets)
    assert sorted(name for name, *_ in slots) == sorted(tensors)
    assert all(offset >= HEADER_BYTES and offset % dtype.itemsize == 0 for _, _, dtype, offset in slots)
    shared = SharedMemory(tmp_path)
    shared.stage(tensors, buckets, version=41)
    assert shared.path.stat().st_size == size and shared.path.stat().st_mode & 0o777 == 0o600
    raw = torch.from_file(str(shared.path), shared=False, size=size, dtype=torch.uint8)
    assert int(raw[:8].view(torch.int64).item()) == 41
    for name, shape, dtype, offset in slots:
        got = raw[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
        want = tensors[name].to(torch.bfloat16) if tensors[name].is_floating_point() else tensors[name]
        assert got.dtype == want.dtype and got.equal(want), name
    shared.stage({k: v + 1 for k, v in tensors.items()}, buckets, version=42)  # same layout: same file, rewritten
    again = torch.from_file(str(shared.path), shared=False, size=size, dtype=torch.uint8)
    name, shape, dtype, offset = slots[0]
    got = again[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
    assert int(again[:8].view(torch.int64).item()) == 42 and got.equal((tensors[name] + 1).to(dtype))
    assert list(tmp_path.iterdir()) == [shared.path]
    shared.close()
    assert list(tmp_path.iterdir()) == []


def test_files_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{SHARED_PREFIX}{dead.stdout.strip()}-0000"
    mine = tmp_path / f"{SHARED_PREFIX}{os.getpid()}-1111"
    odd = tmp_path / f"{SHARED_PREFIX}not-a-pid"
    for path in (orphan, mine, odd):
        path.write_bytes(b"x" * 100)
    shared = SharedMemory(tmp_path)
    assert not orphan.exists() and not odd.exists() and mine.exists()
    assert shared.path.name.startswith(f"{SHARED_PREFIX}{os.getpid()}-")


def test_fits_reads_the_free_space_and_refuses_a_missing_directory(tmp_path):
    assert fits(1, tmp_path)
    assert not fits(1 << 62, tmp_path)
    assert not fits(1, tmp_path / "missing")


async def test_the_hf_engine_serves_pushed_weights_as_it_serves_them_from_disk(bundled_model, tmp_path):
    original, moved = model_tensors(bundled_model), perturbed_weights(bundled_model)
    write_hf_checkpoint(moved, bundled_model, tmp_path / "moved")
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3510, 28, 11173, 411, 4628, 2]
    async with HFEngine(bundled_model) as engine:
        before = await engine.generate(prompt, sampling)
        await engine.load_weights(tmp_path / "moved", version=1)
        from_disk = await engine.generate(prompt, sampling)
        assert from_disk.token_ids != before.token_ids
        await engine.push_weights(original, version=2)
        assert (await engine.generate(prompt, sampling)).token_ids == before.token_ids
        await engine.push_weights(moved, version=3)
        from_memory = await engine.generate(prompt, sampling)
        assert (from_memory.token_ids, from_memory.logprobs) == (from_disk.token_ids, from_disk.logprobs)
        assert from_memory.weight_version == engine.weight_version == 3
        with pytest.raises(EngineError, match="not this model's weights"):
            await engine.push_weights({"model.no_such.weight": torch.zeros(2)}, version=4)
        assert engine.weight_version == 3


async def test_the_hf_engine_samples_anew_for_each_unseeded_request_and_alike_for_one_seed(bundled_model):
    """A GRPO group's samples of one prompt: without a seed each request draws on (and advances) the process's
    random stream, so they differ; with one they repeat, and leave that stream as it was."""
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3510, 28, 11173, 411, 4628, 2]
    async with HFEngine(bundled_model) as engine:
        unseeded = [(await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16))).token_ids
                    for _ in range(4)]
        assert len({tuple(ids) for ids in unseeded}) > 1, unseeded
        state = torch.random.get_rng_state()
        seeded = [(await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=3))).token_ids
                  for _ in range(2)]
        assert seeded[0] == seeded[1] and torch.equal(torch.random.get_rng_state(), state)


def test_the_weight_sync_group_names_mode_transport_and_swap_and_an_engine_refuses_what_it_cannot_take():
    import trainer
    from generators.engines.weight_sync import WeightSyncConfig
    from trainer.config import ConfigError

    cfg = trainer.compose(["weight_sync.transport=group", "weight_sync.swap=interrupt", "weight_sync.mode=memory"])
    assert (cfg.weight_sync.mode, cfg.weight_sync.transport, cfg.weight_sync.swap) == ("memory", "group", "interrupt")
    with pytest.raises(ConfigError, match=r"weight_sync\.transport must be one of auto, shared, group, disk, ray, "
                                          r"got 'nfs'"):
        trainer.compose(["weight_sync.transport=nfs"])
    with pytest.raises(ValueError, match="transport must be one of auto, shared, group, disk, ray, got 'nfs'"):
        WeightSyncConfig(transport="nfs")
    for engine in ("hf", "sglang"):  # they take no transport: refused when the config is checked, not ignored
        with pytest.raises(ConfigError, match=rf"weight_sync\.transport=shared picks how weights reach a vLLM "
                                              rf"server's workers; engine={engine} takes no transport"):
            trainer.compose(["weight_sync.transport=shared", f"inference.engine={engine}"])
    with pytest.raises(ConfigError, match=r"weight_sync\.swap=interrupt needs engine=vllm"):
        trainer.compose(["weight_sync.swap=interrupt", "inference.engine=hf"])
    with pytest.raises(ConfigError, match=r"weight_sync\.transport=ray moves weights through a Ray cluster"):
        trainer.compose(["weight_sync.transport=ray"])
    with pytest.raises(ConfigError, match=r"weight_sync\.transport=ray moves weights through a Ray cluster's object "
                                          r"store, which only placement\.backend=ray joins"):
        trainer.compose(["weight_sync.transport=ray"])
    trainer.compose(["weight_sync.transport=ray", "placement.backend=ray"])


def test_a_transport_is_a_registered_class_and_an_unusable_one_says_why():
    from generators.engines.transports import TRANSPORTS, Server, WeightTransport, transport_class

    assert list(TRANSPORTS) == ["shared", "group", "disk", "ray"]  # auto tries them in this order
    for name in TRANSPORTS:
        cls = transport_class(name)
        assert issubclass(cls, WeightTransport) and cls.name == name
    buckets = plan_buckets(_tensors())
    remote = Server("10.0.0.2", local=False, device="cuda")
    assert transport_class("shared").unusable(remote, buckets) == "it needs a CPU server this engine started"
    assert transport_class("group").unusable(remote, buckets) is None
    assert transport_class("disk").unusable(remote, buckets) == "it needs a server this engine started, on this machine"
    assert transport_class("shared").unusable(Server("127.0.0.1", local=True, device="cuda"), buckets) is not None
    assert not ray.is_initialized()  # a unit test's process is in no cluster
    assert transport_class("ray").unusable(Server("127.0.0.1", local=True, device="cpu"), buckets) == (
        "it needs this process connected to a Ray cluster (ray.init)")
    with pytest.raises(ValueError, match=r"no weight transport 'nfs' \(known: shared, group, disk, ray\)"):
        transport_class("nfs")


def test_weights_packed_for_ray_s_object_store_come_back_equal_in_every_dtype_and_layout():
    from trainer.placement.engine_actors import pack, unpack

    tensors = {"bf16": torch.randn(3, 4).bfloat16(), "int": torch.arange(6).reshape(2, 3),
               "transposed": torch.randn(4, 5).t(), "scalar": torch.tensor(2.5), "fp16": torch.randn(7).half()}
    back = unpack(pack(tensors))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape and back[name].equal(tensor), name


def test_the_cores_a_vllm_server_computes_on_follow_the_config_and_the_trainer_s_mode(monkeypatch):
    import trainer
    from generators.engines.vllm import BIND_ENV
    from trainer.config import ConfigError
    from trainer.placement import Placement

    def binding(*overrides: str) -> str | None:
        cfg = trainer.compose(list(overrides))
        return Placement(cfg).engine("model-dir", Path("out")).server.env.get(BIND_ENV)

    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    monkeypatch.delenv(BIND_ENV)  # conftest sets it for the servers tests start
    assert binding() == every  # sync: nothing else computes while the server generates
    assert binding("trainer.mode=async") is None  # the trainer computes meanwhile: vLLM's own choice
    assert binding("trainer.mode=async", "inference.cpu_cores=all") == every  # asked for by name
    assert binding("inference.cpu_cores=0") == "0" and binding("inference.cpu_cores=vllm") is None
    # a core it cannot run on would let the server start and answer /health, then fail every request
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"cpu_cores=0-{beyond} names no core, or cores this process cannot run on"):
        binding(f"inference.cpu_cores=0-{beyond}")
    monkeypatch.setenv(BIND_ENV, "1")
    assert binding() is None  # the environment's own setting stands (the server inherits it)
    with pytest.raises(ConfigError, match=r"inference\.cpu_cores must be auto, all, vllm or a list of cores such as "
                                          r"0-3 or 0,2; got 'half'"):
        trainer.compose(["inference.cpu_cores=half"])


def test_the_worker_extension_caps_how_long_a_vllm_worker_spins_for_work(monkeypatch, tmp_path):
    """A CPU server's workers (``ENVKIT_VLLM_BUSY_POLL_S``, set by VLLMEngine) busy-poll their queue for that long
    after a read, not vLLM's 1 s, before they wait on its socket. Importing vLLM's queue here also fails loudly if
    vLLM moves it, where the cap would quietly stop applying."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from generators.engines.transports import receiver

    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)  # undone after the test
    monkeypatch.setenv(receiver.BUSY_POLL_ENV, "0.05")
    receiver._shorten_busy_polling()
    receiver._shorten_busy_polling()  # once a process: a second call does not wrap the wrapper
    assert SpinCondition.wait.envkit_limit == "0.05" and not hasattr(SpinCondition.wait.__wrapped__, "envkit_limit")
    context = zmq.Context()
    writer = SpinCondition(is_reader=False, context=context, notify_address=f"ipc://{tmp_path}/notify")
    reader = SpinCondition(is_reader=True, context=context, notify_address=f"ipc://{tmp_path}/notify")
    assert reader.busy_loop_s == 1  # vLLM's default
    reader.record_read()
    reader.wait(timeout_ms=10)
    assert reader.busy_loop_s == 0.05
    for condition in (reader, writer):
        for socket in (condition.local_notify_socket, condition.read_cancel_socket, condition.write_cancel_socket):
            if socket is not None:
                socket.close(linger=0)
    context.term()
