"""Clearing torch's DTensor caches when the process group is re-formed in the same process.

DTensor caches sharding propagation and redistribution plans keyed by specs that compare
device meshes by value (shape, dim names, ranks), not by their process groups. After a group
is destroyed and a new one formed, a new mesh equal in value to an old one can hit a cached
entry that still holds the old mesh, and a later collective fails with "Could not resolve the
process group registered under the name N" (seen with expert-parallel meshes on torch 2.13).
Clear the caches whenever a new mesh is built.
"""

from __future__ import annotations


def clear_dtensor_caches() -> None:
    from torch.distributed.tensor import DTensor, _redistribute

    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(prop, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    gen = getattr(_redistribute, "_gen_transform_infos", None)
    if gen is not None and hasattr(gen, "cache_clear"):
        gen.cache_clear()
