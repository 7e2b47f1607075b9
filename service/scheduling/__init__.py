"""Elastic scheduling across jobs: admission, shrink to share, grow to fill, fair share by owner weight.

`snapshot` is what the policies see, `admission` and `policies` decide (pure functions), `simulator`
replays a job trace against the same policies on a simulated clock, and `autoscaler` asks Ray's
autoscaler for the queued demand. service.scheduler wires the decisions to the store and the supervisors.
"""
