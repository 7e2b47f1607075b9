"""Helpers around a run's state dict: RNG capture/restore, host staging, full gathering.

The state dict itself is the Trainer's (`{"model", "optim", "scheduler", "step", "data", "rng"}`,
DCP-savable, DTensors for sharded values). These helpers are what the checkpoint tiers need:

- `capture_rng` / `restore_rng`: every generator the step may touch, as tensors (DCP-savable).
  Replicated plain tensors are saved once by DCP (deduplicated), so per-rank RNG state that
  differs between ranks must sit under a rank-specific key (`rng_key(rank)`).
- `HostStager`: copies a state dict to host memory with buffers reused between saves, so the
  training loop blocks at most for a memcpy (pinned, on a side stream on CUDA).
- `gather_full`: every tensor as a full (unsharded) CPU tensor, for comparisons and export.
"""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def capture_rng() -> dict[str, torch.Tensor]:
    """Python, torch CPU and (if present) CUDA generator states, as uint8 tensors."""
    state = {
        "python": torch.frombuffer(bytearray(pickle.dumps(random.getstate())), dtype=torch.uint8),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    missing = {"python", "torch"} - set(state)
    if missing:
        raise KeyError(f"rng state lacks {sorted(missing)}; was it made by capture_rng()?")
    random.setstate(pickle.loads(bytes(state["python"].to(torch.uint8).cpu().numpy())))
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8).cpu())


def map_tensors(
    state: Any, fn: Callable[[tuple[str, ...], torch.Tensor], Any], path: tuple[str, ...] = ()
) -> Any:
    """A copy of a nested dict/list structure with every tensor leaf replaced by fn(path, tensor)."""
    if isinstance(state, torch.Tensor):
        return fn(path, state)
    if isinstance(state, dict):
        return {k: map_tensors(v, fn, (*path, str(k))) for k, v in state.items()}
    if isinstance(state, list | tuple):
        out = [map_tensors(v, fn, (*path, str(i))) for i, v in enumerate(state)]
        return type(state)(out) if isinstance(state, tuple) else out
    return copy.deepcopy(state)


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as {"a.b.c": leaf}; lists by index."""
    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = state
    return out


class HostStager:
    """Copies state dicts into host buffers that are allocated once and reused (same structure).

    Reuse is safe because the persistent tier keeps at most one save in flight: a new stage()
    happens only after the previous upload finished reading the buffers.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._bufs: dict[tuple[str, ...], torch.Tensor] = {}
        self._had_cuda = False
        self._stream: Any = None  # torch.cuda.Stream, made on first use

    def _buffer(self, path: tuple[str, ...], src: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pin_memory)
            self._bufs[path] = buf
        return buf

    def _copy(self, path: tuple[str, ...], t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = t._local_tensor.detach()
            buf = self._buffer(path, local)
            buf.copy_(local, non_blocking=local.device.type == "cuda")
            self._had_cuda |= local.device.type == "cuda"
            # Same sharding spec, host-resident local shard: DCP plans from the spec, reads the local.
            return DTensor(buf, t._spec, requires_grad=False)
        src = t.detach()
        buf = self._buffer(path, src)
        buf.copy_(src, non_blocking=src.device.type == "cuda")
        self._had_cuda |= src.device.type == "cuda"
        return buf

    @torch.no_grad()
    def stage(self, state: dict[str, Any], ready: Any = None) -> dict[str, Any]:
        """Copy every tensor of `state` into the host buffers; returns the staged structure.

        On CUDA the copies run on a side stream that first waits for `ready` (a torch.cuda.Event the
        training thread recorded after the optimizer step: `ready_event()`), or, without one, for the
        current stream; stage() returns once they are complete. With `ready` it may run on a thread
        other than the training thread while that thread goes on queueing work.
        """
        self._had_cuda = False
        device = _cuda_device(state)
        if device is None:
            return map_tensors(state, self._copy)
        with torch.cuda.device(device):  # another thread's current device may not be the state's
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            if ready is not None:
                self._stream.wait_event(ready)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                staged = map_tensors(state, self._copy)
            self._stream.synchronize()
        return staged

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def ready_event() -> Any:
    """On CUDA, an event on the current stream (record it after the optimizer step: copies that wait
    for it see that step); None without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.current_stream().record_event()


def _cuda_device(state: Any) -> torch.device | None:
    """The CUDA device of the first CUDA tensor in `state`, or None if it has none."""
    found: list[torch.device] = []

    def look(_path: tuple[str, ...], t: torch.Tensor) -> None:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if not found and local.device.type == "cuda":
            found.append(local.device)

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        map_tensors(state, look)
    return found[0] if found else None


def gather_full(state: Any) -> Any:
    """The same structure with every DTensor replaced by its full tensor on CPU (collective)."""

    def full(_path: tuple[str, ...], t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t.full_tensor().detach().cpu().clone()
        return t.detach().cpu().clone()

    return map_tensors(state, full)
