"""Serving under `mlx.launch`: every rank runs the same batch steps as rank 0's engine."""

import queue
from typing import Dict

import mlx.core as mx

from ..errors import TernaryError
from ..memory import materialize
from ..parallel import agree_seed, share_json
from .engine import POLL_S, Engine, Job


class LockstepEngine(Engine):
    """serve.Engine for one rank of a group: every rank runs the same batch steps.

    Each round rank 0 (the HTTP server's engine) decides what to admit and what to cancel
    and sends it to the others as JSON; every rank then inserts, removes and steps alike,
    so the collectives inside the model meet. The other ranks' jobs are never read.

    A failed round is recovered as on one rank (Engine._reset): every rank fails its
    batch, empties its caches and starts a new generator, so a fault every rank meets at
    the same step (they run the same shapes) leaves the group in step, and rank 0 answers
    the failed requests with an error. A fault on one rank alone leaves the others inside
    a collective that rank no longer joins: the group is out of step; restart it.
    """

    def __init__(self, model, tokenizer, *args, group, **kwargs):
        super().__init__(model, tokenizer, *args, **kwargs)
        self.group, self.leader = group, group.rank() == 0
        seed = agree_seed(None, group)  # None on a group of one: nothing to agree on
        if seed is not None:
            mx.random.seed(seed)  # unseeded sampling draws alike everywhere
        self._held: Dict[int, Job] = {}  # rank 0: jobs sent, by round id
        self._next_rid = 0
        self._stop_sent = False

    def _round(self, block: bool) -> dict:
        """Rank 0: this round's new jobs, the cancelled ones, and whether to stop."""
        new = []
        while len(self.active) + len(new) < self.max_concurrency:  # as Engine._admit
            try:
                job = self.inbox.get(timeout=POLL_S) if block else self.inbox.get_nowait()
            except queue.Empty:
                break
            block = False
            if not job.cancelled.is_set():
                job.rid, self._next_rid = self._next_rid, self._next_rid + 1
                self._held[job.rid] = job
                new.append(job)
        stop = self._stop.is_set()
        self._stop_sent |= stop
        return {
            "stop": stop,
            "cancel": [j.rid for j in self.active.values() if j.cancelled.is_set()],
            "jobs": [
                {
                    "rid": j.rid,
                    "prompt": j.prompt,
                    "max_tokens": j.max_tokens,
                    "sampling": j.sampling,
                    "stop": j.stop,
                    "logprobs": j.logprobs,
                    "echo": j.echo,
                    "grammar": j.grammar,
                }
                for j in new
            ],
        }

    def _admit(self, gen, block: bool):
        msg = share_json(self._round(block) if self.leader else None, self.group, self.leader)
        if msg["stop"]:
            self._stop.set()
        uids = {job.rid: uid for uid, job in self.active.items()}
        gone = [uids[rid] for rid in msg["cancel"] if rid in uids]
        if gone:
            gen.remove(gone)
            for uid in gone:
                del self.active[uid]
        for spec in msg["jobs"]:
            job = (
                self._held.pop(spec["rid"])
                if self.leader
                else Job(
                    prompt=spec["prompt"],
                    max_tokens=spec["max_tokens"],
                    sampling=spec["sampling"],
                    stop=spec["stop"],
                    logprobs=spec["logprobs"],
                    echo=spec["echo"],
                    grammar=spec["grammar"],
                )
            )
            job.rid = spec["rid"]
            self._start(gen, job)

    def _drop_cancelled(self, gen):
        pass  # rank 0 decides in _admit, for every rank at once

    def run_loop(self):
        try:
            super().run_loop()
        finally:
            if self.leader and not self._stop_sent:  # release the others
                self._stop.set()
                share_json(self._round(False), self.group, True)


def follow(engine: LockstepEngine) -> int:
    """Run a non-zero rank's engine on this thread until rank 0 stops.

    Returns the number of tokens generated; raises TernaryError if the engine failed."""
    materialize(engine.model)
    engine.run_loop()
    if engine.failed:
        raise TernaryError(
            f"rank {engine.group.rank()}: the generation engine stopped ({engine.failed})"
        )
    return engine.tokens_generated
