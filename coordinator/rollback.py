"""Rolling a sharded coordinator back together: when one shard came back from a checkpoint behind a round the others
had published (it was killed between a close and that close's checkpoint, or checkpoints every few rounds), the islands
hold that round's values and the shard does not: no round could close consistently again. Every shard then stops
with ROLL_BACK_EXIT and is started again with --resume (by `serve --shards K`, torchrun, SLURM or a StatefulSet), so
all of them resume from the newest checkpoint they all committed, and the islands go back with them as they do after a
one-process coordinator's restart (islands/round.py _rewind): the rounds since that checkpoint are trained again.

The leading shard decides (coordinator/gather.py FollowerRounds sees every follower's closes and its restarts) and
tells the followers (CloseRound with roll_back, signed like every close)."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

# The exit status of a shard that stops to be resumed with the others (EX_TEMPFAIL: try again). Its launcher starts it
# again with --resume, as it does a shard killed by a signal (coordinator/launch.py).
ROLL_BACK_EXIT = 75


class RolledBack(Exception):
    """The shard stopped to resume with the others from their newest common checkpoint."""


class RollBack:
    """A shard's request to stop and resume with the others: set once, from any thread; the serving loop ends on it
    and checkpoints are no longer written (a checkpoint of this shard's rounds after the decision would give the
    shards a newer common step that is not one round on every shard)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.reason = ""

    def request(self, reason: str) -> None:
        if not self.requested.is_set():
            self.reason = reason
            log.error("%s: every coordinator shard stops and resumes from the newest checkpoint they all committed "
                      "(exit %d; the islands go back with them)", reason, ROLL_BACK_EXIT)
            self.requested.set()

    def check(self) -> None:
        """Raises RolledBack once requested."""
        if self.requested.is_set():
            raise RolledBack(self.reason)
