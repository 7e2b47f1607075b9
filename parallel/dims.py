"""ParallelDims: a layout's sizes, checked against the layout rules (parallel/layout_rules.py), and
its DeviceMesh. Importing this module loads no torch; only `ParallelDims.build_mesh` does.

The mesh always has every named dimension, even those of size 1, so other code can ask for
`dims.get_mesh(mesh, "tp")` or `"pp"` without asking first whether that dimension is in use
(use `get_mesh` rather than `mesh[name]`: it also returns the flattened sub-meshes):

    base dims (outer -> inner): "pp", "dp_replicate", "dp_shard", "cp", "tp"
    with ep > 1, "dp_shard" is split into "dp_shard_mod_ep" x "dp_shard_in_ep" (as torchtitan does),
    so that experts can be sharded over "ep" = dp_shard_in_ep x cp.

Flattened sub-meshes (torchtitan's names):
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
    def mesh_dim_names(self) -> tuple[str, ...]:
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep > 1 else ("dp_shard",)
        return ("pp", "dp_replicate", *shard, "cp", "tp")

    def mesh_shape(self) -> tuple[int, ...]:
        shard = (self.dp_shard_mod_ep, self.dp_shard_in_ep) if self.ep > 1 else (self.dp_shard,)
        return (self.pp, self.dp_replicate, *shard, self.cp, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with its flattened sub-meshes; a collective: call on every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        from parallel.dist import reset_dtensor_caches

        reset_dtensor_caches()  # a re-formed group's meshes equal the old ones: drop stale cache hits
        mesh = init_device_mesh(device_type, self.mesh_shape(), mesh_dim_names=self.mesh_dim_names())
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep > 1 else ("dp_shard",)
        self._flat = {}
        if self.ep > 1:
            self._flat["dp_shard"] = mesh[shard]._flatten("dp_shard")
            self._flat["ep"] = mesh[("dp_shard_in_ep", "cp")]._flatten("ep")
        self._flat["dp"] = mesh[("dp_replicate", *shard)]._flatten("dp")
        self._flat["dp_shard_cp"] = mesh[(*shard, "cp")]._flatten("dp_shard_cp")
        self._flat["dp_cp"] = mesh[("dp_replicate", *shard, "cp")]._flatten("dp_cp")
        return mesh

    def get_mesh(self, mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by name: a base dim ("tp", "pp", ...), a flattened one ("dp", "dp_shard_cp",
        "dp_cp", "ep"), or a tuple of them (e.g. ("dp_replicate", "dp_shard_cp") for HSDP)."""
        if isinstance(names, str):
            if names in self._flat:
                return self._flat[names]
            return mesh[names]
        if len(names) == 1:
            return self.get_mesh(mesh, names[0])
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
        return 0 if mesh is None else self.get_mesh(mesh, "dp").get_local_rank()
