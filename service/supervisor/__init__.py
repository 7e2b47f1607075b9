"""One detached, named supervisor actor per job (`job-<id>/supervisor`): it runs the job.

It reserves one placement group per data-parallel replica, starts the worker actors, hands each
its rank in generation 0, and then watches: run results (errors, actor and node death from Ray),
heartbeats (a silent worker is hung), step timings (stragglers). On a failure it recovers in
the same processes: bump the generation, stop the survivors, drop broken replicas, choose the
new dp degree (ScalingPolicy), re-form the group, restore the last committed state (resharded
to the new layout), and go on with the same data order. Replacements start in the background;
when a spare replica is ready and dp < max, the job grows at the next snapshot boundary.

It reports every transition as an event (to the job store when it has a store_url, and to an
in-actor list that `unbroken run` polls with `.events.remote(after=i)`), writes metrics.jsonl
in the job's output folder, and releases its workers, placement groups and scratch state when
the job ends. When it crashes itself, Ray restarts it (max_restarts); the new instance finds
the job's workers by name and carries on from the last committed state.

The parts, one file each:
    actor.py        the Ray actor (inbox, cancel, status, events) and launch/find/wait_done
    controller.py   the job's life as states carrying their data, one step() at a time
    kept_notes.py   the rows and output lines live workers kept that the supervisor lacks
    generations.py  start, watch and stop one generation; rank_of
    pool.py         the replica pool (ReplicaState) and its worker actors
    leftovers.py    a job's detached actors, placement groups and keeper shards, found by name and released
    spares.py       the warm spares beside the group: watched, counted, told (events, gauge, rows)
    spare_watch.py  warm spares found dead, stopped or silent, dropped before a failure picks one
    upload_wait.py  a resize held while a persistent checkpoint uploads
    detection.py    failures (FailureKind), hangs, stragglers, the root cause
    agents.py       the node agents' batches of notes, and what their silence says
    node_helpers.py a node's keeper and agent, started ahead where a replica waits to join
    committer.py    snapshot acks and commits, the restore target
    keeper_set.py   the job's snapshot keepers: started, watched, started again
    reporter.py     events, job states, the store, metrics.jsonl, TensorBoard, logs
    recovery_clock.py a recovery timed from its fault to its first step, and its `recovered` event
    pauses.py       how long training paused at each re-form, from the rows
    store_writer.py the reporter's writes to the job store, in order, on their own thread
    context.py      what the parts share about the job (JobRun)
    ray_poll.py     which refs asked for earlier are in, without waiting
    words.py        how failures and restores read in events
"""

from checkpointing.naming import NAMESPACE, supervisor_name, worker_name
from service.supervisor.actor import Supervisor, find_supervisor, launch_supervisor, wait_done
from service.supervisor.context import JobFailed
from service.supervisor.generations import rank_of

__all__ = [
    "NAMESPACE", "JobFailed", "Supervisor", "find_supervisor", "launch_supervisor", "rank_of", "supervisor_name",
    "wait_done", "worker_name",
]
