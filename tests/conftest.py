"""Shared test setup. Fixtures that start servers or clusters stop them by PID, even on failure."""

from __future__ import annotations

import os

# Keep each test process to one intra-op thread: 2 cores are shared by many ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray on loopback only (see service/local_cluster.py); must be set before ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
