"""ParallelDims: a layout's sizes, checked against the layout rules (parallel/layout_rules.py), and
its DeviceMesh. Importing this module loads no torch; only `ParallelDims.build_mesh` does.

The mesh has only the dimensions of size > 1 (as torchtitan builds it): torch makes a process group
for each group of every mesh dimension, and with gloo each is a store barrier on every rank, so
the 4 size-1 dims of a 1-D FSDP layout cost 4 x world `new_group` calls at each (re-)form (20-90 ms
for 4 ranks on 2 cores) that no collective ever used. Two size-1 dims stay where a mesh is built
over them: "dp_shard" under HSDP (its 2-D FSDP mesh is (dp_replicate, dp_shard_cp)) and the two
parts of dp_shard under ep. Ask for a sub-mesh only where its dimension is in use (`*_enabled`);
use `get_mesh` rather than `mesh[name]`: it also returns the flattened sub-meshes.

    dims (outer -> inner): "pp", "dp_replicate", "dp_shard", "cp", "tp"
    with ep > 1, "dp_shard" is split into "dp_shard_mod_ep" x "dp_shard_in_ep" (as torchtitan does),
    so that experts can be sharded over "ep" = dp_shard_in_ep x cp.

Flattened sub-meshes (torchtitan's names), each over those of its dims that the mesh has (absent
where it has none of them, i.e. where its size is 1):
    "dp"          = dp_replicate x dp_shard       -- data loading: which slice of the global batch
    "dp_shard_cp" = dp_shard x cp                 -- FSDP shards parameters over this
    "dp_cp"       = dp_replicate x dp_shard x cp  -- the loss (token sums) is all-reduced over this
    with ep > 1 also "dp_shard" (flattened from its two parts) and "ep" = dp_shard_in_ep x cp.

tp is innermost, so a tensor-parallel group is made of neighbouring ranks (one node on GPUs).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parallel.layout_rules import (
    LayoutProblem,
    ModelShape,
    ParallelDimsError,
    ParallelSection,
    Schedule,
    TrainShape,
    ep_problems,
    local_batch_size,
    model_problems,
    pipeline_problems,
    world_problems,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class _OneStage:
    """The schedule ParallelDims.validate assumes when it is given no parallelism section."""

    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int = 1
    pp_split: list[int] | None = None


# --- ParallelDims ---------------------------------------------------------------------------------


@dataclass(kw_only=True)  # keywords only: the sizes are easy to swap by position
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    # Flattened sub-meshes by name, kept from build_mesh (slicing them from the root is deprecated).
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dp_shard, problems = world_problems(self, self.world_size)
        if dp_shard is not None and not problems:
            problems = ep_problems(dp_shard, self.cp, self.ep)
        if problems:
            raise ParallelDimsError(problems)
        assert dp_shard is not None
        self.dp_shard = dp_shard

    @classmethod
    def from_config(cls, cfg: ParallelSection, world_size: int) -> ParallelDims:
        if cfg.auto:
            raise ParallelDimsError([LayoutProblem(
                "parallelism", "parallelism: auto must be resolved by the planner before the engine starts",
                "give explicit sizes (dp_shard, tp, ...) or run the planner")])
        return cls(
            dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, tp=cfg.tp,
            pp=cfg.pp, ep=cfg.ep, world_size=world_size,
        )

    # --- degrees -------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many slices the global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that hold a copy (or a shard) of each parameter and average its gradient."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.dp_shard_in_ep

    # --- model-dependent checks ------------------------------------------------------------
    def validate(self, model: ModelShape, train: TrainShape, parallel: Schedule | None = None) -> None:
        """The rules that need the model, the training sizes and the pipeline schedule (one stage per
        rank when `parallel` is not given); raises ParallelDimsError naming every problem."""
        sched: Any = parallel if parallel is not None else _OneStage()
        stages = sched.pp_stages_per_rank if self.pp > 1 else 1
        problems = model_problems(model, train, tp=self.tp, cp=self.cp, ep=self.ep, dp=self.dp) + pipeline_problems(
            self.pp, sched.pp_schedule, stages, sched.pp_microbatches, sched.pp_split, model,
            self.local_batch_size(train.global_batch_size))
        if problems:
            raise ParallelDimsError(problems)

    # --- batch arithmetic --------------------------------------------------------------------
    def local_batch_size(self, global_batch_size: int) -> int:
        """Samples each dp rank runs per step (the last ranks pad with zero-weight samples)."""
        return local_batch_size(global_batch_size, self.dp)

    # --- mesh --------------------------------------------------------------------------------
    def _shard_dims(self) -> list[tuple[str, int]]:
        """dp_shard as the mesh has it: split in two under ep (see the module's docstring)."""
        if self.ep > 1:
            return [("dp_shard_mod_ep", self.dp_shard_mod_ep), ("dp_shard_in_ep", self.dp_shard_in_ep)]
        return [("dp_shard", self.dp_shard)]

    def _all_dims(self) -> list[tuple[str, int]]:
        return [("pp", self.pp), ("dp_replicate", self.dp_replicate), *self._shard_dims(), ("cp", self.cp),
                ("tp", self.tp)]

    def _mesh_dims(self) -> list[tuple[str, int]]:
        """The dims the mesh is built with: those of size > 1, and the shard dims where a mesh is built
        over them at size 1 (HSDP's 2-D FSDP mesh, ep's expert mesh)."""
        keep = {n for n, _ in self._shard_dims()} if self.ep > 1 or self.dp_replicate > 1 else set()
        return [(n, s) for n, s in self._all_dims() if s > 1 or n in keep]

    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._mesh_dims())

    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self._mesh_dims())

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with its flattened sub-meshes; a collective: call on every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        from parallel.dist import reset_dtensor_caches

        reset_dtensor_caches()  # a re-formed group's meshes equal the old ones: drop stale cache hits
        names = self.mesh_dim_names()
        mesh = init_device_mesh(device_type, self.mesh_shape(), mesh_dim_names=names)
        shard = tuple(n for n, _ in self._shard_dims())
        self._flat = {}

        def flatten(parts: tuple[str, ...], name: str) -> None:
            present = tuple(p for p in parts if p in names)
            if present:
                self._flat[name] = mesh[present]._flatten(name)

        if self.ep > 1:
            flatten(shard, "dp_shard")
            flatten(("dp_shard_in_ep", "cp"), "ep")
        flatten(("dp_replicate", *shard), "dp")
        flatten((*shard, "cp"), "dp_shard_cp")
        flatten(("dp_replicate", *shard, "cp"), "dp_cp")
        return mesh

    def get_mesh(self, mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by name: a dim the mesh has ("tp", "pp", ...), a flattened one ("dp",
        "dp_shard_cp", "dp_cp", "ep"), or a tuple of them (e.g. ("dp_replicate", "dp_shard_cp") for
        HSDP). Raises KeyError for one the mesh lacks because its size is 1."""
        if isinstance(names, str):
            names = (names,)
        missing = [n for n in names if n not in self._flat and n not in (mesh.mesh_dim_names or ())]
        if missing:
            raise KeyError(f"the mesh has no {missing} dimension: only dims of size > 1 are built "
                           f"(sizes {dict(self._all_dims())}); ask for it only where it is in use")
        if len(names) == 1:
            return self._flat[names[0]] if names[0] in self._flat else mesh[names[0]]
        with warnings.catch_warnings():
            # torch >= 2.11 warns that slicing flattened dims from the root will go away; a
            # multi-dim slice mixing base and flattened dims has no other spelling on 2.11 yet.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh[names]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: 2D (replicate, shard) for HSDP, else the flat dp_shard x cp."""
        if self.dp_replicate > 1:
            return self.get_mesh(mesh, ("dp_replicate", "dp_shard_cp"))
        return self.get_mesh(mesh, "dp_shard_cp")

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among the dp slices of the global batch."""
        return 0 if mesh is None or self.dp == 1 else self.get_mesh(mesh, "dp").get_local_rank()
