"""The trainer a worker keeps from one generation to the next.

A generation that ends without finishing (a peer failed, or the supervisor paused it for a re-form)
leaves its model, optimizer and data in this process. When the next generation gives this worker the
same place (rank, world size, dp), it trains on in those objects over the new group
(parallel.regroup), after restoring the committed snapshot into them: no model build, no data
opening, no DTensor planning from cold. Any other place builds afresh, as the first generation did.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

log = logging.getLogger(__name__)

Place = tuple[int, int, int]  # (world_size, rank, dp)


class KeptTrainer:
    def __init__(self) -> None:
        self._place: Place | None = None
        self._trainer: Any = None

    def keep(self, place: Place, trainer: Any) -> bool:
        """After a generation that did not finish, before its group is destroyed: keep `trainer` for a
        next generation in the same place, if its layout allows. Returns whether it was kept."""
        from parallel import regroup

        if not regroup.can_keep(trainer):
            return False
        try:
            regroup.detach(trainer)
        except Exception as e:  # noqa: BLE001 - an FSDP state we cannot reset: the next one builds afresh
            log.warning("the trainer could not be kept for the next generation: %s: %s", type(e).__name__, e)
            return False
        self._place, self._trainer = place, trainer
        return True

    def take(self, place: Place, cfg: Any, device: Any, *, restoring: bool) -> tuple[Any, bool]:
        """The trainer for a new generation in `place`, on the group just joined: the kept one (True) when
        the place is the same and a state will be restored into it, else a new one (False). A
        collective: every rank of the group builds the mesh here once, kept or not."""
        from parallel import regroup
        from parallel.trainer import Trainer

        trainer, self._trainer = self._trainer, None
        same = trainer is not None and restoring and self._place == place
        self._place = None
        if same:
            mesh = regroup.attach(trainer)
            if mesh is None:
                return trainer, True
            log.warning("the re-formed group's process groups did not take the old names: building afresh")
            dims = trainer.dims
            del trainer
            gc.collect()
            return Trainer(cfg, device=device, built=(dims, mesh), restoring=restoring), False
        del trainer
        # The old model's memory, before the new one is built. Also with none to drop (generation 0): the
        # garbage of the start-up (data, checks) is collected here, not by the collector during the first
        # steps, where a make demo run's first persistent upload then lagged past a failure 1.4 s later.
        gc.collect()
        return Trainer(cfg, device=device, restoring=restoring), False

    def drop(self) -> None:
        self._place, self._trainer = None, None
