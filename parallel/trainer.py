"""The Trainer: one rank's engine. Builds the mesh, model, optimizer, schedule and data, and
runs train steps; its state is DCP-savable and reshardable to another dp degree.

Order of construction (torchtitan's): model on the meta device -> [pipeline: cut into this
rank's stages, each then treated as a whole model] -> tensor parallel -> expert parallel ->
context parallel (attention swapped for ring attention) -> activation checkpointing -> compile ->
FSDP (experts in their own group) -> materialise and init weights (each parameter from its own
seeded generator, so every layout starts from the same values) or load HF weights. With pp > 1
the step runs the schedule (`parallel.pp_step`); with cp > 1 each sequence is cut zigzag.

One step: every dp rank runs the same number of micro-batches over its slice of the global
batch (padding rows weigh zero); each micro-batch's loss is the *sum* of token losses divided by
the global count of loss-bearing tokens of the step (B x seq_len, fewer under a fine-tuning
format's loss mask; every rank computes it from the data alone); FSDP averages gradients over its
fsdp_size ranks, so the loss fed to backward is multiplied by fsdp_size to turn that average into
the plain sum. The reported loss is the all-reduced sum over dp x cp divided by that count. With
`data.document_mask` each batch carries document ids and attention stays inside each document.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel import dist as pdist
from parallel.ac import apply_ac
from parallel.config import EngineConfig
from parallel.cp import apply_cp, builtin_cp_context, shard_batch
from parallel.data import IGNORE_INDEX, Batch, DataLoader
from parallel.dims import ParallelDims
from parallel.ep import apply_ep, apply_expert_fsdp, expert_fsdp_mesh
from parallel.evaluate import eval_due, evaluate, perplexity
from parallel.fsdp import apply_fsdp, needs_sync_toggle
from parallel.live_state import LiveStateDict
from parallel.loss import loss_context, token_loss_sum
from parallel.metrics import device_peak_flops, flops_per_token, mfu, peak_memory_bytes
from parallel.model import build_model, init_weights
from parallel.moe import global_moe_metrics, set_aux_scale, set_row_mask
from parallel.optim import build_optimizer, build_scheduler, clip_grad_norm_, set_scheduler_step
from parallel.pp import Pipeline
from parallel.tp import apply_tp


@dataclass
class StepMetrics:
    step: int  # the global step just completed (1-based count of completed steps)
    loss: float  # global mean loss over the global batch (same value on every rank)
    tokens: int  # tokens in the global batch
    dp: int
    world_size: int
    step_time_s: float
    tokens_per_s: float
    lr: float
    grad_norm: float
    peak_mem_bytes: int  # cuda max_memory_allocated, or process peak RSS on CPU
    mfu: float | None  # None where the device peak FLOP/s is unknown (CPU)
    extra: dict[str, float] = field(default_factory=dict)
    eval_loss: float | None = None  # mean loss on data.eval, at steps where it was evaluated
    eval_ppl: float | None = None  # exp(eval_loss)


class Trainer:
    def __init__(self, cfg: EngineConfig, *, device: torch.device | None = None,
                 built: tuple[ParallelDims, DeviceMesh] | None = None, restoring: bool = False) -> None:
        """torch.distributed must already be initialised (any world size), or not at all for world 1.
        `built`: the dims and mesh already built for this group (parallel.regroup.attach's fallback).
        `restoring`: a whole state is loaded into it next, so the weights are not drawn (nor read from
        model.init_from): a re-formed group's ranks would only overwrite them."""
        self.cfg = cfg
        self._restoring = restoring
        self.device = torch.device(device) if device is not None else pdist.default_device()
        world = pdist.world_size()
        if built is not None:
            self.dims, self.mesh = built
            pdist.reset_dtensor_caches()
        else:
            self.dims = ParallelDims.from_config(cfg.parallelism, world)
            self.dims.validate(cfg.model, cfg.training, cfg.parallelism)
            pdist.reset_dtensor_caches()  # a re-formed group must not meet plans cached for the old one
            self.mesh = self.dims.build_mesh(self.device.type) if world > 1 else None
        self.dp_rank = self.dims.dp_rank(self.mesh)
        t = cfg.training
        self.bf16 = t.dtype == "bfloat16"
        self.pipeline: Pipeline | None = None  # set when pp > 1 (see parallel.pp_step)
        self.model: nn.Module = self._build_model()
        if cfg.model.moe is not None:
            # One sequence's load-balancing loss weighs coef / global batch; times fsdp_size, as
            # the token loss is, because FSDP averages gradients.
            aux_scale = cfg.model.moe.aux_loss_coef * self.dims.fsdp_size / t.global_batch_size
            set_aux_scale(self.model, aux_scale)
        self.optimizer = build_optimizer(self.model, t, self.device)
        self._live_state = LiveStateDict()
        self.scheduler = build_scheduler(self.optimizer, t)
        if cfg.data.document_mask and self.dims.cp_enabled and cfg.parallelism.cp_impl == "builtin":
            raise ValueError("data.document_mask: parallelism.cp_impl=builtin (torch's context_parallel) cannot keep "
                             "attention inside documents; use cp_impl: ring")
        if t.eval_every is not None and cfg.data.eval is None:
            raise ValueError(f"training.eval_every={t.eval_every} but data.eval is not set; give data.eval "
                             "(a held-out set or {split: 0.01}) or drop eval_every")
        self.data = DataLoader(cfg.data, t.seq_len, t.global_batch_size, cfg.model.vocab_size, t.micro_batch_size)
        self.step = 0
        torch.manual_seed(t.seed)
        self._loss_parallel = self.dims.tp_enabled and cfg.parallelism.loss_parallel
        # FSDP averages gradients over its ranks; scale up so the result is the plain sum.
        self._grad_scale = float(self.dims.fsdp_size) / self.data.tokens_per_step()
        self._flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self._peak_flops = device_peak_flops(self.device, t.dtype)

    # --- construction ----------------------------------------------------------------------
    def _build_model(self) -> nn.Module:
        model = build_model(self.cfg.model, device="meta")
        if self.dims.pp_enabled:  # each stage is parallelised like a whole model
            from parallel.pp_step import build_pipeline

            self.pipeline, view = build_pipeline(model, self, self._parallelize, self._pp_loss)
            return view
        return self._parallelize(model)

    def _pp_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, targets) * self._grad_scale

    def _parallelize(self, model: nn.Module) -> nn.Module:
        cfg, dims, p, t = self.cfg, self.dims, self.cfg.parallelism, self.cfg.training
        if dims.tp_enabled:
            assert self.mesh is not None
            apply_tp(model, dims.get_mesh(self.mesh, "tp"), sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
        if dims.ep_enabled:
            assert self.mesh is not None
            apply_ep(model, dims.get_mesh(self.mesh, "ep"))
        if dims.cp_enabled:
            assert self.mesh is not None
            apply_cp(model, dims.get_mesh(self.mesh, "cp"), impl=p.cp_impl)
        apply_ac(model, t.activation_checkpointing)
        if t.compile:
            for name, block in list(model.layers.items()):
                model.layers[name] = torch.compile(block)
        self.fsdp = dims.fsdp_enabled
        if self.fsdp:
            assert self.mesh is not None
            # Pipeline stages keep parameters gathered after forward: zero-bubble schedules need it.
            reshard = False if dims.pp_enabled else None
            if dims.ep_enabled:
                apply_expert_fsdp(
                    model, expert_fsdp_mesh(dims, self.mesh), dims.fsdp_size,
                    reshard_after_forward=p.zero_stage == 3 and not dims.pp_enabled,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    if self.bf16 else None,
                )
            apply_fsdp(
                model, dims.fsdp_mesh(self.mesh), zero_stage=p.zero_stage,
                param_dtype=torch.bfloat16 if self.bf16 else torch.float32, reduce_dtype=torch.float32,
                cpu_offload=p.cpu_offload, device_type=self.device.type, reshard_after_forward=reshard,
                unit_mib=p.fsdp_unit_mib,
            )
        init_device = torch.device("cpu") if (self.fsdp and p.cpu_offload) else self.device
        init_weights(model, cfg.model, device=init_device, values=not self._restoring)
        if cfg.model.init_from and not self._restoring:
            from parallel.hf import load_hf_weights  # lazy: safetensors only when asked for

            load_hf_weights(model, cfg.model, cfg.model.init_from)
        return model

    # --- training ----------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 without FSDP (whose MixedPrecisionPolicy casts instead): autocast."""
        if self.bf16 and not self.fsdp:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self) -> StepMetrics:
        t0 = time.perf_counter()
        t = self.cfg.training
        self.model.train()
        micro = self.data.micro_batches(self.step, self.dp_rank, self.dims.dp)
        loss_tokens = max(self.data.loss_tokens(self.step), 1)  # a step of prompts only adds nothing
        self._grad_scale = float(self.dims.fsdp_size) / loss_tokens
        lr = self.optimizer.param_groups[0]["lr"]
        toggle = self.fsdp and needs_sync_toggle(self.cfg.parallelism.zero_stage)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.pipeline is not None:
            loss_sum += self.pipeline_run(micro, train=True) / self._grad_scale
            micro = []
        for i, batch in enumerate(micro):
            if toggle:
                self.model.set_requires_gradient_sync(i == len(micro) - 1)
            with self.micro_batch(batch) as (inputs, targets, kwargs):
                if self.cfg.model.moe is not None:  # padding rows add no load-balancing gradient
                    set_row_mask(self.model, (targets != IGNORE_INDEX).any(dim=1))
                with self._autocast():
                    logits = self.model(inputs, **kwargs)
                loss = token_loss_sum(logits, targets)
                (loss * self._grad_scale).backward()
            loss_sum += loss.detach()
        pp_group = self.dims.get_mesh(self.mesh, "pp").get_group() if self.mesh is not None and self.dims.pp_enabled else None
        gnorm = clip_grad_norm_(self.model.parameters(), t.grad_clip, pp_group)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mesh is not None and self.dims.dp_cp > 1:
            dist.all_reduce(loss_sum, group=self.dims.get_mesh(self.mesh, "dp_cp").get_group())
        tokens = self.data.tokens_per_step()
        loss_value = float(loss_sum) / loss_tokens
        self._sync()
        self.step += 1
        dt = time.perf_counter() - t0
        tps = tokens / dt
        metrics = StepMetrics(
            step=self.step, loss=loss_value, tokens=tokens, dp=self.dims.dp, world_size=self.dims.world_size,
            step_time_s=dt, tokens_per_s=tps, lr=lr, grad_norm=gnorm,
            peak_mem_bytes=peak_memory_bytes(self.device),
            mfu=mfu(tps, self._flops_per_token, self._peak_flops, self.dims.world_size),
            extra=global_moe_metrics(self.model, self.cfg.model.n_layers, self.dims.cp)
            if self.cfg.model.moe is not None else {},
        )
        if eval_due(self.step, self.cfg):  # after the step's metrics: its time is not the step's
            metrics.eval_loss, metrics.extra["eval_time_s"] = evaluate(self)
            metrics.eval_ppl = perplexity(metrics.eval_loss)
        return metrics

    @contextlib.contextmanager
    def micro_batch(self, batch: Batch) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """(inputs, targets, model kwargs) of one micro-batch on this rank's device, cut to its cp shard,
        inside the contexts its forward and backward need (loss parallel, builtin CP)."""
        inputs, targets = batch.inputs, batch.targets
        positions = None
        cp_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.dims.cp_enabled and self.cfg.parallelism.cp_impl == "ring":  # this rank's zigzag shard
            assert self.mesh is not None
            cp = self.dims.get_mesh(self.mesh, "cp")
            inputs, targets, positions = shard_batch(inputs, targets, cp.get_local_rank(), cp.size())
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        positions = positions.to(self.device) if positions is not None else None
        doc_ids = batch.doc_ids.to(self.device, non_blocking=True) if batch.doc_ids is not None else None
        if self.dims.cp_enabled and self.cfg.parallelism.cp_impl == "builtin":
            # torch shards the three buffers in place inside the context (CUDA only).
            assert self.mesh is not None
            inputs, targets = inputs.contiguous(), targets.contiguous()
            positions = torch.arange(inputs.shape[1], device=self.device)
            cp_ctx = builtin_cp_context(self.dims.get_mesh(self.mesh, "cp"), [inputs, targets, positions], [1, 1, 0])
        with cp_ctx, loss_context(self._loss_parallel):
            yield inputs, targets, {"positions": positions, "doc_ids": doc_ids}

    def pipeline_run(self, micro: list[Batch], *, train: bool) -> torch.Tensor:
        """This rank's rows through the pipeline schedule (forward and backward, or forward only);
        returns the sum of what the loss function returned, on every pp rank."""
        from parallel.pp_step import pipeline_step

        assert self.mesh is not None and self.pipeline is not None
        with loss_context(self._loss_parallel), self._autocast():
            pp_group = self.dims.get_mesh(self.mesh, "pp").get_group()
            cp_rank = self.dims.get_mesh(self.mesh, "cp").get_local_rank() if self.dims.cp_enabled else 0
            return pipeline_step(self.pipeline, micro, self.device, pp_group, cp_rank, self.dims.cp, train=train)

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The whole train state: sharded (DTensor) model and optimizer, DCP-savable and reshardable.
        Its tensors are the live ones (parallel.live_state keeps their mapping between calls)."""
        model_sd, optim_sd = self._live_state.get(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": {"last_epoch": self.scheduler.last_epoch},
            "step": self.step,
            "data": self.data.state_dict(self.step),
            "rng": {"seed": self.cfg.training.seed, "cpu": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from `state_dict()` (of this or another layout, resharded by DCP or in memory)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.data.check_state(state.get("data", {}))
        if self._live_state.holds(self.optimizer, state["model"], state["optim"]):
            # Loaded in place into the live tensors (a restore into `state_dict()`): only the optimizer's
            # hyper-parameters, which DCP's load replaced in the dicts it was given, are left to set.
            for live, loaded in zip(self.optimizer.param_groups, state["optim"]["param_groups"], strict=True):
                live.update({k: v for k, v in loaded.items() if k != "params"})
        else:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            self._live_state.drop()
        self.step = int(state["step"])
        set_scheduler_step(self.scheduler, int(state.get("scheduler", {}).get("last_epoch", self.step)))
        rng = state.get("rng", {})
        if isinstance(rng.get("cpu"), torch.Tensor):
            torch.set_rng_state(rng["cpu"].to("cpu", torch.uint8))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) model tensors in our naming, on CPU; valid on rank 0 (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.mesh is None:
            return {k: v.detach().cpu().clone() for k, v in get_model_state_dict(self.model).items()}
        if self.pipeline is not None:  # each pp rank gathers its stages, pp rank 0 merges them
            from parallel.pp_step import gather_full_state

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            local = {k: v.detach().cpu().clone() for k, v in full.items()}
            return gather_full_state(local, self.dims.get_mesh(self.mesh, "pp").get_group())
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # On a CPU device a gathered (or replicated) tensor may share storage with the live
        # parameter; clone so the result stays a snapshot while training goes on.
        return {k: v.detach().clone() for k, v in get_model_state_dict(self.model, options=opts).items()}
