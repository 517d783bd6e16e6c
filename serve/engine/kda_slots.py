"""Which KDA slot holds what: the CacheManager's slot bookkeeping (the manager owns the memory and
copies states in and out; this decides which slot).

A slot holds a running sequence's state or a prefix-cache snapshot. There are max_num_seqs slots
for running sequences plus the reserved snapshot slots, and a snapshot may take any free one: the
slots no running sequence needs now hold snapshots too, so the snapshots' share grows as
concurrency falls, and a sequence that arrives takes a slot back from the snapshot worth least.

Worth (GreedyDual-Size-Frequency): floor + (1 + uses) x the tokens a resume from the snapshot
saves past its base (the deepest snapshot before it on a prefix more requests matched: a
conversation's snapshot past a system prompt saves only its own part), where uses counts the
requests that matched its page (for a conversation's newest snapshot, also those its earlier
turns' snapshots served), and the floor rises to the worth of each snapshot given up. A
much-used shared prefix thus outlives a stream of one-off prompts, worth that is not renewed
fades, and a new snapshot worth less than every kept one is declined.

Admission (a doorkeeper, as in TinyLFU): a snapshot no request has used yet (uses 0) never
displaces one that has served a request; it takes a free slot or another unused one's. Each
prompt brings several snapshots (every `snapshot_interval` pages, its last full page, its
generated pages), so without this a few prompts' untried snapshots push out a shared system
prompt's before its next request comes (measured: hit rate 0.0 with 3 reserved slots). A prefix
that comes back is counted on its cached pages whether or not its snapshot was kept, so its next
snapshot enters as used.
"""
from __future__ import annotations

from typing import Protocol


class Snapshotted(Protocol):
    """A cached page as the slot table sees it (the table sets `snapshot_slot` and `worth`)."""

    depth: int
    base: int
    hits: int
    inherited: int
    snapshot_slot: int | None
    worth: float


def used(page: Snapshotted) -> bool:
    """Has the snapshot's page (or, for a conversation's newest, its earlier turns') served a request?"""
    return page.hits + page.inherited > 0


class SlotTable:
    def __init__(self, num_slots: int, max_running: int, page_size: int) -> None:
        self.max_running, self.page_size = max_running, page_size
        self._free = list(range(num_slots - 1, -1, -1))
        self.running = 0  # slots held by sequences
        self._snapshots: dict[int, Snapshotted] = {}  # slot -> the page whose snapshot it holds
        self._floor = 0.0
        self.evicted = self.declined = 0

    @property
    def snapshots(self) -> int:
        return len(self._snapshots)

    def take_running(self, keep: Snapshotted | None = None) -> int | None:
        """A slot for a sequence, given up by the snapshot worth least if none is free (never
        `keep`'s while another can go); None when max_running sequences hold slots already."""
        if self.running >= self.max_running:
            return None
        if not self._free:  # then snapshots hold every slot no sequence does
            self._give_up(self._least_worth(exclude=keep) or keep)
        self.running += 1
        return self._free.pop()

    def release_running(self, slot: int) -> None:
        self._free.append(slot)
        self.running -= 1

    def worth(self, page: Snapshotted) -> float:
        return self._floor + (1 + page.hits + page.inherited) * (page.depth - page.base) * self.page_size

    def renew(self, page: Snapshotted) -> None:
        """page's uses changed: its snapshot's worth follows."""
        if page.snapshot_slot is not None:
            page.worth = self.worth(page)

    def keep(self, page: Snapshotted) -> int | None:
        """A slot for page's new snapshot (set as page.snapshot_slot), giving up a snapshot worth
        no more than it if none is free; None (declined) otherwise."""
        worth = self.worth(page)
        if not self._free:
            victim = self._least_worth()
            if victim is None or (used(victim), victim.worth) > (used(page), worth):
                self.declined += 1
                return None
            self._give_up(victim)
        page.snapshot_slot, page.worth = self._free.pop(), worth
        self._snapshots[page.snapshot_slot] = page
        return page.snapshot_slot

    def drop(self, page: Snapshotted) -> None:
        """Forget page's snapshot (its slot is free again)."""
        if page.snapshot_slot is not None:
            del self._snapshots[page.snapshot_slot]
            self._free.append(page.snapshot_slot)
        page.snapshot_slot = None

    def _least_worth(self, exclude: Snapshotted | None = None) -> Snapshotted | None:
        # Unused ones first; among equals the deepest, so a chain loses its end.
        return min((p for p in self._snapshots.values() if p is not exclude),
                   key=lambda p: (used(p), p.worth, -p.depth), default=None)

    def _give_up(self, page: Snapshotted) -> None:
        self._floor = max(self._floor, page.worth)
        self.evicted += 1
        self.drop(page)
