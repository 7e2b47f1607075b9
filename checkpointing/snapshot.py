"""The in-memory snapshot tier, worker side: send a rank's shard to two keepers; restore from them.

    client = SnapshotClient(job_id, rank, world_size, node_name, keepers, optimizer=trainer.optimizer)
    handle = client.snapshot(trainer.state_dict(), trainer.step, generation)  # after the step
    handle.add_done_callback(lambda r: ...)   # r: SnapshotResult(ok, acked=[nodes], errors), on a thread
    ...train on...
    # supervisor, once every rank reported ok: keeper.commit_snapshot(keepers, job_id, generation, step, world)
    client.close()    # before the group re-forms or the state is replaced; build a new client after

    state = trainer.state_dict()                 # built for the NEW mesh (any dp degree)
    info = restore_from_keepers(keepers, job_id, state, step=step)   # no collectives; SnapshotLost
    info = restore_with_fallback(keepers, job_id, state, manager)    # collective: agrees, falls back
    trainer.load_state_dict(state)

The two sides live in their own modules: checkpointing.snapshot_send (the copy off the training
path, overlapped with the next forward/backward, and the send to the keepers) and
checkpointing.snapshot_restore (finding a committed snapshot and loading it, resharded).
"""

from checkpointing.snapshot_restore import (
    RestoreInfo,
    SnapshotLost,
    restore_from_keepers,
    restore_with_fallback,
)
from checkpointing.snapshot_send import SnapshotClient, SnapshotHandle, SnapshotResult, replica_nodes

__all__ = [
    "RestoreInfo",
    "SnapshotClient",
    "SnapshotHandle",
    "SnapshotLost",
    "SnapshotResult",
    "replica_nodes",
    "restore_from_keepers",
    "restore_with_fallback",
]
