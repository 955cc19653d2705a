from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier import StateError
from kvtier.lease import CallbackHold, LeaseTable
from kvtier.memory import BlockPool
from kvtier.memory.device import Direction
from tests.memory.late_copies import LateCopies


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    p = BlockPool(4, 4096)
    yield p
    p.close()


def test_end_releases_everything_once(pool: BlockPool) -> None:
    table = LeaseTable(pool)
    released: list[str] = []
    lease = table.open("r1")
    lease.take_pages(pool.allocate(2) or [])
    lease.take_hold(CallbackHold(10, "pin x", lambda: released.append("x")))
    assert table.end("r1") is True
    assert pool.free_pages == 4 and released == ["x"]
    assert table.end("r1") is False  # second end: no-op, no second decrement
    lease.release()  # releasing the object again is a no-op too
    assert pool.free_pages == 4 and released == ["x"]


def test_taking_into_an_ended_lease_gives_it_back(pool: BlockPool) -> None:
    table = LeaseTable(pool)
    lease = table.open("r1")
    table.end("r1")
    pages = pool.allocate(2) or []
    with pytest.raises(StateError, match="ended"):
        lease.take_pages(pages)
    assert pool.free_pages == 4
    released: list[int] = []
    with pytest.raises(StateError):
        lease.take_hold(CallbackHold(0, "h", lambda: released.append(1)))
    assert released == [1]


def test_snapshot_reports_who_holds_what(pool: BlockPool) -> None:
    table = LeaseTable(pool)
    table.open("a").take_pages(pool.allocate(1) or [])
    table.open("b").take_hold(CallbackHold(100, "disk pin k", lambda: None))
    infos = {i.request_id: i for i in table.snapshot()}
    assert infos["a"].pinned_pages == 1 and infos["a"].pinned_bytes == 4096
    assert infos["b"].holds == ("disk pin k",) and infos["b"].pinned_bytes == 100
    assert table.end_all() == 2 and pool.free_pages == 4


def test_joining_an_ended_request_is_refused_but_the_request_itself_may_start_over(
    pool: BlockPool,
) -> None:
    table = LeaseTable(pool, ended_memory=2)
    table.open("late")
    table.end("late")
    with pytest.raises(StateError, match="already ended"):
        table.join("late")  # a late PD reservation: no lease nobody would end
    assert table.snapshot() == []
    table.open("late")  # the request id reused by a new request (a lookup) starts over
    assert [i.request_id for i in table.snapshot()] == ["late"]
    assert table.join("late") is table.get("late")
    table.end("late")
    for rid in ("a", "b"):  # the memory of ended ids is bounded
        table.open(rid)
        table.end(rid)
    table.join("late").release()


def test_a_hold_given_back_early_is_reported_no_more(pool: BlockPool) -> None:
    table = LeaseTable(pool)
    released: list[str] = []
    hold = CallbackHold(100, "pd reservation", lambda: released.append("h"))
    table.open("r").take_hold(hold)
    hold.release()  # e.g. a failed transfer gives its reservation back before the request ends
    (info,) = table.snapshot()
    assert info.pinned_bytes == 0 and info.holds == ()
    assert table.end("r") and released == ["h"]  # the lease's release is a no-op for it


def test_unclaimed_leases_expire_unless_claimed_or_busy(pool: BlockPool) -> None:
    table = LeaseTable(pool)
    released: list[str] = []
    for rid in ("ghost", "claimed", "busy"):
        table.join(rid).take_hold(CallbackHold(1, rid, lambda rid=rid: released.append(rid)))
    table.open("claimed")  # the request itself came: no longer expires
    now = table.get("ghost").joined  # type: ignore[union-attr]
    assert table.expire_unclaimed(10.0, now=now + 5.0) == []  # not yet
    assert table.expire_unclaimed(10.0, now=now + 10.0, busy={"busy"}) == ["ghost"]
    assert released == ["ghost"]
    assert table.end("ghost") is False  # already ended: nothing released twice
    with pytest.raises(StateError):
        table.join("ghost")  # a late reservation for it is refused
    # busy restarted its clock at now + 10: it expires 10 s after that, not before
    assert table.expire_unclaimed(10.0, now=now + 19.0) == []
    assert table.expire_unclaimed(10.0, now=now + 20.0) == ["busy"]
    assert sorted(released) == ["busy", "ghost"] and table.end("claimed")


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_a_copy_from_a_lease_that_ended_first_lands_before_copying_returns(
    pool: BlockPool, lying: bool
) -> None:
    """A load's copy out of the lease's page is reported (``copying``) after the request
    ended and its page went back: ``copying`` waits for it there and then, so a store that
    reuses the page next cannot write under the copy. The copy lands only when waited for
    (tests/memory/late_copies.py); a lying fence (no wait) must see the reuse's bytes."""
    copies = LateCopies(lying=lying)
    table = LeaseTable(pool)
    lease = table.open("r")
    page = pool.allocate(1) or []
    lease.take_pages(page)
    view = pool.page_bytes_view(page[0], 64)
    view.copy_(torch.arange(64, dtype=torch.uint8))
    out = copies.mark(torch.zeros(64, dtype=torch.uint8))
    batch = copies.begin(out, Direction.LOAD)
    batch.copy(out, view)
    landed = batch.close()
    table.end("r")  # another path ended the request: its page is free
    lease.copying(landed)
    again = pool.allocate(4) or []
    assert page[0] in again  # the page, reused by the next store
    pool.page_bytes_view(page[0], 64).fill_(255)
    copies.drain()
    assert torch.equal(out, torch.arange(64, dtype=torch.uint8)) is not lying
    pool.release(again)
