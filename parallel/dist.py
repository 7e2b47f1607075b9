"""Process-group helpers: backend and device choice, joining and leaving a group.

NCCL on CUDA, gloo on CPU, chosen from the device. A group is formed from an explicit store
(a TCPStore on a fresh port per generation), so the same processes can leave and re-form
a group of another size, as elastic recovery does.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return torch.device("cuda", local)
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def make_store(host: str, port: int, world: int, is_master: bool, timeout_s: float = 60.0) -> dist.TCPStore:
    """A TCPStore; the master passes port=0 to get a free one (read it back with `.port`)."""
    return dist.TCPStore(
        host, port, world, is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def reset_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions, which hold DeviceMesh objects.

    A DeviceMesh compares equal to another over the same ranks with the same dim names, whatever
    process groups are behind it; DTensor's sharding-propagation caches are keyed that way. After
    a group is destroyed and re-formed in the same process, a cache hit would hand back the old
    mesh, whose group names are dead or (worse) name another group of the new world. Called
    whenever a group is formed or left and whenever a mesh is built.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    prop = DTensor._op_dispatcher.sharding_propagator
    # A new thread-local cache object: clears every thread's Python cache, not only this one's.
    prop.propagate_op_sharding = LocalLRUCache(prop.propagate_op_sharding_non_cached)
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ fast path's cache (this thread's)
        clear_native()
    # Process-wide caches keyed by specs (which hold meshes): tensor metadata and redistribution plans.
    from torch.distributed.tensor import _redistribute

    for cached in (getattr(prop, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None)):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def init_process_group(
    rank: int,
    world: int,
    store: dist.Store,
    device: torch.device | str | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Join a group of `world` ranks through `store`; the backend follows the device."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; call destroy_process_group() first")
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    reset_dtensor_caches()
    dist.init_process_group(
        backend=backend_for(device), store=store, rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    """Leave the group (if any); safe to call twice."""
    if dist.is_available() and dist.is_initialized():
        reset_dtensor_caches()
        dist.destroy_process_group()
