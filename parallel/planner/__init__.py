"""The layout planner: memory and time estimates of parallel layouts, pure arithmetic (no torch).

Public entry points: `plan`, `choose_layout`, `check_fits` (search.py), `plan_from_spec`
(report.py), `make_cluster` and the hardware presets (hardware.py).
"""

from parallel.planner.hardware import HARDWARE, Cluster, Hardware, PlanError, make_cluster
from parallel.planner.report import plan_from_spec
from parallel.planner.search import Candidate, PlanResult, Rejected, check_fits, choose_layout, plan

__all__ = [
    "HARDWARE", "Candidate", "Cluster", "Hardware", "PlanError", "PlanResult", "Rejected", "check_fits",
    "choose_layout", "make_cluster", "plan", "plan_from_spec",
]
