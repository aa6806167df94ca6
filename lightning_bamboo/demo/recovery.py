"""The demo's recovery clock: the seconds from each loss to the step that recovered from it, and how it recovered."""

from __future__ import annotations


class RecoveryClock:
    """Seconds from each kill to the completed step that recovered from it.

    A step that a restart from a checkpoint then undoes does not count if it finished after the last loss
    (a survivor may complete one before that loss is found): those kills are recovered when the restarted
    job completes a step, as checkpoint-restart's kills are. A recovery that was complete before that loss
    stands: the job had recovered, and the later loss's own recovery is counted from its own time.
    """

    def __init__(self) -> None:
        self._done: list[tuple[float, float]] = []  # (kill time, seconds): recoveries no restart can undo any more
        self._open: list[float] = []  # kill times not recovered from yet
        self._job: list[tuple[float, int, float]] = []  # (kill time, recovering step, seconds) in the running job
        self._restarted: set[float] = set()  # kill times whose recovery went through a restart from a checkpoint
        self._cold: set[float] = set()  # ... through a restart that had to start new processes (none kept)
        self._last = float("-inf")  # the time of the last kill

    def killed(self, at: float) -> None:
        self._open.append(at)
        self._last = max(self._last, at)

    def stepped(self, step: int, at: float) -> None:
        self._job += [(kill, step, at - kill) for kill in self._open]
        self._open.clear()

    def restarted(self, from_step: int, cold: bool = False) -> None:
        """The job restarts from the checkpoint of ``from_step``: steps after it are undone. ``cold``: no
        process of the job was ready to run the next one: every node starts a new one, or the restart
        waited for joining nodes still starting."""
        for kill, step, seconds in self._job:
            if step > from_step and kill + seconds >= self._last:  # finished after the last loss: undone
                self._open.append(kill)
            else:
                self._done.append((kill, seconds))
        self._job.clear()
        self._restarted.update(self._open)
        if cold:
            self._cold.update(self._open)

    def started_cold(self) -> None:
        """The restarted job started a new process for one of its ranks (none kept or pooled was left for it):
        the recoveries it brings waited for that start."""
        self._cold.update(self._open)

    def _all(self) -> list[tuple[float, float]]:
        return self._done + [(kill, seconds) for kill, _, seconds in self._job]

    @property
    def seconds(self) -> list[float]:
        return [seconds for _, seconds in self._all()]

    @property
    def kinds(self) -> list[str]:
        """Per recovery in ``seconds``: "cold_restart" if it waited for a restart from a checkpoint in processes
        that had to start (none ready), "restart" if it went through one in ready processes, else "failover"."""
        return ["cold_restart" if kill in self._cold else "restart" if kill in self._restarted else "failover"
                for kill, _ in self._all()]
