"""ParallelDims: the sizes of each parallel dimension, their checks, and the DeviceMesh.

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

import math
import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import ModelConfig, ParallelConfig, TrainConfig


class ParallelDimsError(ValueError):
    """A layout that cannot run; the message names the sizes and how to fix them."""


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
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelDimsError(f"{name}={value!r} must be a positive integer")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others:
                raise ParallelDimsError(
                    f"dp_replicate*cp*tp*pp={others} does not divide world_size={self.world_size}; "
                    f"change the sizes or the number of workers so dp_shard=-1 can fill the world"
                )
            self.dp_shard = self.world_size // others
        elif not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ParallelDimsError(f"dp_shard={self.dp_shard!r} must be a positive integer or -1 (fill)")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate*dp_shard*cp*tp*pp={product} != world_size={self.world_size}; "
                f"make the sizes multiply to the world size (or set dp_shard: -1 to fill it)"
            )
        if self.ep > 1:
            if (self.dp_shard * self.cp) % self.ep:
                raise ParallelDimsError(
                    f"ep={self.ep} does not divide dp_shard*cp={self.dp_shard * self.cp}; experts are "
                    f"sharded over part of dp_shard x cp, so pick an ep that divides it"
                )
            if self.ep % self.cp:
                raise ParallelDimsError(
                    f"cp={self.cp} does not divide ep={self.ep}; the ep group spans all of cp, "
                    f"so ep must be a multiple of cp"
                )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        if cfg.auto:
            raise ParallelDimsError(
                "parallelism: auto must be resolved by the planner before the engine starts; "
                "give explicit sizes (dp_shard, tp, ...) or run the planner"
            )
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
    def validate(self, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig | None = None) -> None:
        """Checks that need the model and training sizes; raises ParallelDimsError naming the field."""
        errors: list[str] = []
        if self.tp > 1:
            for field, value in (
                ("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads),
                ("ffn dim (hidden_dim)", model.ffn_dim), ("vocab_size", model.vocab_size),
            ):
                if value % self.tp:
                    errors.append(f"tp={self.tp} does not divide {field}={value}; pick a tp that divides it")
            if model.moe is not None and model.moe.hidden_dim is not None and model.moe.hidden_dim % self.tp:
                errors.append(f"tp={self.tp} does not divide moe.hidden_dim={model.moe.hidden_dim}")
        if self.cp > 1 and train.seq_len % (2 * self.cp):
            errors.append(
                f"cp*2={2 * self.cp} does not divide training.seq_len={train.seq_len}; zigzag context "
                f"parallelism cuts each sequence into 2*cp chunks"
            )
        if self.ep > 1:
            if model.moe is None:
                errors.append(f"ep={self.ep} needs a mixture-of-experts model (model.moe); set ep: 1")
            elif model.moe.num_experts % self.ep:
                errors.append(
                    f"ep={self.ep} does not divide moe.num_experts={model.moe.num_experts}; "
                    f"pick an ep that divides it"
                )
        if self.pp > 1:
            stages = self.pp * (parallel.pp_stages_per_rank if parallel is not None else 1)
            if model.n_layers < stages:
                errors.append(
                    f"pp stages={stages} exceed n_layers={model.n_layers}; every stage needs a layer"
                )
        if train.global_batch_size < self.dp:
            errors.append(
                f"training.global_batch_size={train.global_batch_size} is smaller than dp={self.dp}; "
                f"raise the batch or lower dp_replicate*dp_shard"
            )
        if train.seq_len > model.max_seq_len:
            errors.append(f"training.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len}")
        if errors:
            raise ParallelDimsError("; ".join(errors))

    # --- batch arithmetic --------------------------------------------------------------------
    def local_batch_size(self, global_batch_size: int) -> int:
        """Samples each dp rank runs per step (the last ranks pad with zero-weight samples)."""
        return math.ceil(global_batch_size / self.dp)

    # --- mesh --------------------------------------------------------------------------------
    def mesh_dim_names(self) -> tuple[str, ...]:
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep > 1 else ("dp_shard",)
        return ("pp", "dp_replicate", *shard, "cp", "tp")

    def mesh_shape(self) -> tuple[int, ...]:
        shard = (self.dp_shard_mod_ep, self.dp_shard_in_ep) if self.ep > 1 else (self.dp_shard,)
        return (self.pp, self.dp_replicate, *shard, self.cp, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with its flattened sub-meshes; a collective: call on every rank."""
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
