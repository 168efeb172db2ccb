"""The fleet-wide replay limit: at most K in flight, FIFO grants, releases never leak slots."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.ingest.replaylimit import ReplayLimiter


class Client:
    def __init__(self, name: str) -> None:
        self.name = name
        self.granted: list[float] = []

    def grant_replay(self, now: float) -> None:
        self.granted.append(now)


def test_grants_in_order_when_slots_free():
    lim = ReplayLimiter(2)
    a, b, c, d = (Client(x) for x in "abcd")
    assert lim.acquire(a) and lim.acquire(b)
    assert not lim.acquire(c) and not lim.acquire(d)
    assert not lim.acquire(c)  # asking twice does not queue twice
    lim.release(a, 1.0)
    assert c.granted == [1.0] and d.granted == []
    lim.release(d, 2.0)  # d gives up its queued request
    lim.release(b, 3.0)
    assert d.granted == [] and lim.active == {c}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=80))
def test_never_more_than_k_in_flight(k, ops):
    lim = ReplayLimiter(k)
    clients = [Client(str(i)) for i in range(8)]
    for t, (acquire, i) in enumerate(ops):
        c = clients[i]
        if acquire:
            lim.acquire(c)
        else:
            lim.release(c, float(t))
        assert len(lim.active) <= k
        assert not (lim.active & set(lim.waiting))
        # No slot is left idle while someone waits.
        assert not lim.waiting or len(lim.active) == k
