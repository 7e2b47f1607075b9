"""Which errors mean "the group broke under it" (a peer failed: the save or step is abandoned with its
generation) and which are the job's own (reported as such): workers.worker_tiers.is_collective_error."""

from __future__ import annotations

import pytest
import torch.distributed

from workers.worker_tiers import NothingToRestore, is_collective_error


@pytest.mark.parametrize("error", [
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
    # An async persistent save still running when its generation's group was destroyed (seen in make soak).
    ValueError("Group <torch.distributed.distributed_c10d.ProcessGroup object at 0x7f50> is not registered, "
               "please create group with torch.distributed.new_group API"),
    RuntimeError("Timed out waiting 10000ms for recv operation to complete"),
    # A survivor joining the next generation when the rendezvous store's host (rank 0) was lost with its
    # node (goodput_bench: a sigkill, then a node loss during the re-form): it must be kept, not replaced.
    torch.distributed.DistNetworkError("Broken pipe"),
    RuntimeError("DistNetworkError: Broken pipe"),  # as a run result's error string carries it
    BrokenPipeError(32, "Broken pipe"),
])
def test_a_broken_group_is_a_collective_error(error: BaseException) -> None:
    assert is_collective_error(error)


@pytest.mark.parametrize("error", [
    NothingToRestore("training progressed but no state can be restored: set fault_tolerance.restart_from_scratch"),
    OSError("NoSuchBucket: the bucket does not exist"),
    ValueError("shape mismatch for layers.0.attention.wq.weight"),
])
def test_the_jobs_own_errors_are_not(error: BaseException) -> None:
    assert not is_collective_error(error)
