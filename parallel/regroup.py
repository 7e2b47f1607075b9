"""Keep a Trainer (model, optimizer, data) across a re-formed group of the same layout.

A DeviceMesh names its process groups and looks them up by name at each use; torch names groups by
a counter that destroying the default group resets. A rank that forms the next group the same way
(default group, then the mesh and its flattened sub-meshes, in the same order) gets groups with
the old names, so the old meshes, and the DTensors and modules built over them, resolve to the new
groups. What holds a group object rather than its name is FSDP's per-module mesh info: `detach`
drops those (so the old group really closes), `attach` points them at the new groups.

Only for layouts whose every group lives in the mesh (no pipeline, expert or context parallelism:
those keep groups of their own) and on CPU: a CUDA communicator aborted in a collective may leave
stream work behind that no test here has shown drained, so CUDA builds afresh.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.dims import ParallelDims


def can_keep(trainer: Any) -> bool:
    """Whether `trainer` can be carried into a next generation of the same layout."""
    dims: ParallelDims = trainer.dims
    return (trainer.mesh is not None and trainer.device.type == "cpu"
            and not (dims.pp_enabled or dims.ep_enabled or dims.cp_enabled))  # fmt: skip


def _fsdp_groups(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, Any] = {}  # by id: the blocks of one unit share their group
    for m in model.modules():
        if isinstance(m, FSDPModule):
            g = m._get_fsdp_state()._fsdp_param_group
            if g is not None:
                groups[id(g)] = g
    return list(groups.values())


def _mesh_infos(group: Any) -> list[Any]:
    infos = {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None}
    for p in group.fsdp_params:
        for i in (p.mesh_info, p.post_forward_mesh_info):
            if i is not None:
                infos[id(i)] = i
    return list(infos.values())


def _meshes(trainer: Any) -> list[DeviceMesh]:
    return [trainer.mesh, *trainer.dims._flat.values()]


def detach(trainer: Any) -> None:
    """Drop every reference the trainer holds to its group's objects (not to their names), so that
    destroying the group closes it, and put FSDP back in its between-steps state: a failure may have
    stopped it mid-forward or mid-backward, holding gathered parameters and gradients."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import ShardedState

    trainer.optimizer.zero_grad(set_to_none=True)
    for g in _fsdp_groups(trainer.model):
        if g._sharded_state != ShardedState.SHARDED:
            g._training_state = TrainingState.IDLE  # reshard() frees the gathered copies only when idle
            g.reshard()
        for p in g.fsdp_params:  # gradients the broken backward computed but never reduced
            p.unsharded_accumulated_grad = None
            if getattr(p, "_unsharded_param", None) is not None:
                p._unsharded_param.grad = None
        g._training_state = TrainingState.IDLE
        g._all_gather_result = None
        g._post_reduce_event = None
        g._reshard_after_forward_event = None
        g._partial_reduce_output = None
        g._all_reduce_state = None
        g._post_forward_indices.clear()
        g.comm_ctx.all_gather_state = None
        g.comm_ctx.reduce_scatter_states.clear()
        g.comm_ctx.post_forward_order.clear()
        for info in _mesh_infos(g):
            info.shard_process_group = None
            info.reduce_scatter_process_group = None
            if hasattr(info, "replicate_process_group"):
                info.replicate_process_group = None
    from torch.distributed.fsdp import FSDPModule

    for m in trainer.model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            state._training_state = TrainingState.IDLE
            ctx = state._state_ctx
            ctx.iter_forward_root = None
            ctx.post_backward_final_callback_queued = False
            ctx.is_last_backward = True
            ctx.post_optim_event = None
    for mesh in _meshes(trainer):
        mesh._pg_registry = {}


def attach(trainer: Any) -> DeviceMesh | None:
    """On every rank of the new group, after joining it: build the mesh again (a collective, in the
    same order as the Trainer's own build). Returns None when the kept trainer now runs over the new
    groups, else the mesh just built (its groups did not get the old names), for a fresh Trainer to
    use (`Trainer(..., built=(dims, mesh))`: building it again would create groups no peer creates)."""
    dims: ParallelDims = trainer.dims
    old = _meshes(trainer)
    old_flat = dict(dims._flat)
    mesh = dims.build_mesh(trainer.device.type)
    new = [mesh, *dims._flat.values()]
    if [m._dim_group_names for m in old] != [m._dim_group_names for m in new]:
        return mesh
    dims._flat = old_flat  # the old meshes, whose names now resolve to the new groups
    for o, n in zip(old, new, strict=True):
        o._pg_registry = dict(n._pg_registry)
    for g in _fsdp_groups(trainer.model):
        for info in _mesh_infos(g):
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            if hasattr(info, "replicate_mesh_dim"):
                info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
    return None

