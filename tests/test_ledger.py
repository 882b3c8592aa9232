"""The data ledger: leases of sample positions, the checks at a push, the fold, and the account."""

from __future__ import annotations

import random

import pytest

from coordinator.ledger import DataLedger, LeaseBound, RangeSet
from diloco.wire.refusal import Refused
from diloco.wire.refusal import Reason

pytestmark = pytest.mark.unit

SEQ = 16  # tokens per sample


def _positions(ranges) -> set[int]:
    return {p for a, b in ranges for p in range(a, b)}


def test_range_set_matches_a_set_of_positions_under_random_operations():
    rng = random.Random(7)
    rs, model = RangeSet(), set()
    for _ in range(2000):
        a = rng.randrange(0, 300)
        b = a + rng.randrange(0, 20)
        op = rng.random()
        if op < 0.5:
            assert rs.add(a, b) == len(model & set(range(a, b)))
            model |= set(range(a, b))
        elif op < 0.8:
            rs.remove(a, b)
            model -= set(range(a, b))
        else:
            got = rs.take(b - a)
            want = sorted(model)[: b - a]
            assert _positions(got) == set(want)
            model -= set(want)
        assert _positions(rs) == model
        assert rs.overlap(a, b) == len(model & set(range(a, b)))
        assert _positions(rs.within(a, b)) == model & set(range(a, b))
        pairs = list(rs)
        assert all(s < e for s, e in pairs) and all(e1 < s2 for (_, e1), (s2, _) in zip(pairs, pairs[1:])), pairs


def test_leases_are_disjoint_across_islands_and_the_same_for_the_same_index():
    ledger = DataLedger(epoch_size=1000, tokens_per_sample=SEQ)
    a0, b0, a1 = ledger.lease("a", 0, 100), ledger.lease("b", 0, 100), ledger.lease("a", 1, 100)
    assert ledger.lease("a", 0, 100) == a0 and ledger.lease("b", 0, 5) == b0  # every rank and group asks
    assert len(_positions(a0) | _positions(b0) | _positions(a1)) == 300
    with pytest.raises(Refused) as e:
        ledger.lease("a", 2, 0)
    assert e.value.reason == Reason.BAD_REQUEST


def test_a_push_may_name_only_its_own_unfolded_positions_and_their_exact_tokens():
    ledger = DataLedger(1000, SEQ)
    (mine,), (theirs,) = ledger.lease("a", 0, 64), ledger.lease("b", 0, 64)
    first = (mine[0], mine[0] + 32)
    ledger.check("a", 0, [first], 32 * SEQ)
    for ranges, tokens, reason in [
        ([first], 31 * SEQ, Reason.BAD_REQUEST),  # tokens must be the samples' tokens
        ([theirs], 64 * SEQ, Reason.NOT_LEASED),  # another island's samples
        ([(mine[0], mine[1] + 1)], 65 * SEQ, Reason.NOT_LEASED),  # one beyond the lease
        ([first, (mine[0] + 8, mine[0] + 9)], 33 * SEQ, Reason.BAD_REQUEST),  # overlapping ranges
        ([], 32 * SEQ, Reason.BAD_REQUEST),  # tokens claimed with no samples named: weight nobody can account for
    ]:
        with pytest.raises(Refused) as e:
            ledger.check("a", 0, ranges, tokens)
        assert e.value.reason == reason, ranges
    assert ledger.fold(0, [first]) == 32
    with pytest.raises(Refused) as e:
        ledger.check("a", 0, [first], 32 * SEQ)  # folded already: never twice
    assert e.value.reason == Reason.NOT_LEASED


def test_positions_handed_back_are_leased_again_and_the_account_adds_up():
    ledger = DataLedger(100, SEQ)
    a = ledger.lease("a", 0, 60)
    b = ledger.lease("b", 0, 60)  # crosses into epoch 1
    ledger.fold(0, [(a[0][0], a[0][0] + 40)])
    assert ledger.give_back("a", [(a[0][0] + 40, a[0][1])]) == 20
    assert ledger.give_back("a", [(a[0][0], a[0][0] + 1)]) == 0  # folded positions are not handed back
    c = ledger.lease("c", 0, 30)
    assert _positions(c) >= _positions([(a[0][0] + 40, a[0][1])])  # the returned ones go first
    acct = ledger.account(0, live=["b", "c"])
    assert (acct.leased, acct.folded, acct.returned, acct.repeated) == (150 * SEQ, 40 * SEQ, 20 * SEQ, 0)
    assert acct.held == 90 * SEQ and acct.lost == 0 and acct.epoch == 1
    # b dies: what it held is lost
    assert ledger.account(0, live=["c"]).lost == 60 * SEQ
    assert _positions(b) == set(range(60, 120))


def test_an_old_lease_asked_again_comes_back_without_what_was_folded_meanwhile():
    ledger = DataLedger(1000, SEQ, fragments=2)
    (r,) = ledger.lease("a", 0, 50)
    ledger.fold(0, [(r[0], r[0] + 10)])
    ledger.fold(1, [(r[0] + 20, r[0] + 30)])
    assert ledger.lease("a", 0, 50) == [(r[0] + 10, r[0] + 20), (r[0] + 30, r[1])]


def test_the_ledger_survives_a_checkpoint_exactly():
    ledger = DataLedger(1000, SEQ, fragments=2)
    for i, island in enumerate(["a", "b", "a"]):
        ledger.lease(island, i, 40)
    ledger.fold(1, ledger.lease("a", 0, 1))
    ledger.give_back("b", ledger.lease("b", 1, 1)[:1])
    again = DataLedger(1000, SEQ, fragments=2)
    again.load_state_dict(ledger.state_dict())
    assert again.state_dict() == ledger.state_dict()
    assert again.lease("c", 0, 10) == ledger.lease("c", 0, 10)
    with pytest.raises(ValueError, match="samples an epoch"):
        DataLedger(999, SEQ, fragments=2).load_state_dict(ledger.state_dict())


def test_who_gets_which_positions_does_not_depend_on_who_asks_first():
    members = ["island-0", "island-1", "island-2"]

    def run(order: list[str]) -> dict:
        ledger = DataLedger(10_000, SEQ)
        for index in range(3):
            for island in order:
                ledger.lease(island, index, 50, members)
        return {(i, k): ledger.lease(i, k, 50, members) for i in members for k in range(3)}

    one = run(["island-0", "island-1", "island-2"])
    assert one == run(["island-2", "island-0", "island-1"]) == run(["island-1", "island-2", "island-0"])
    # Islands in step take consecutive blocks in id order.
    assert [one[(i, 1)] for i in members] == [[(150, 200)], [(200, 250)], [(250, 300)]]


def test_leases_granted_ahead_go_back_when_an_island_leaves_or_dies():
    ledger = DataLedger(10_000, SEQ)
    assert ledger.lease("island-0", 0, 10, ["island-0", "island-1"]) == [(0, 10)]
    assert ledger.leases["island-1"][0] == [(10, 20)]  # granted with island-0's, before island-1 asked
    assert ledger.release("island-1") == 10
    assert ledger.lease("island-0", 1, 10, ["island-0"]) == [(10, 20)]
    assert ledger.account(0, live=["island-0"]).lost == 0


def test_a_bounded_island_holds_its_rounds_ahead_and_each_closed_round_gives_one_back():
    ledger, bound = DataLedger(10_000, SEQ), LeaseBound(per_round=10, rounds=2)
    with pytest.raises(Refused) as e:
        ledger.lease("a", 0, 11, ["a"], bound)  # more than a round of its ranks' samples in one lease
    assert e.value.reason == Reason.BAD_REQUEST
    first, second = ledger.lease("a", 0, 10, ["a"], bound), ledger.lease("a", 1, 10, ["a"], bound)
    assert ledger.lease("a", 0, 10, ["a"], bound) == first  # asked again (another rank): nothing more taken
    with pytest.raises(Refused) as e:
        ledger.lease("a", 2, 10, ["a"], bound)
    assert e.value.reason == Reason.RATE_LIMITED
    ledger.settle(0, [first], ["a"])  # a round closed
    ledger.lease("a", 2, 10, ["a"], bound)
    with pytest.raises(Refused):
        ledger.lease("a", 3, 10, ["a"], bound)
    for _ in range(5):  # rounds closing while it takes nothing refill at most its bound
        ledger.settle(0, [], ["a"])
    ledger.lease("a", 3, 10, ["a"], bound), ledger.lease("a", 4, 10, ["a"], bound)
    with pytest.raises(Refused):
        ledger.lease("a", 5, 10, ["a"], bound)


def test_what_a_leaving_island_never_named_in_a_push_is_leased_again():
    ledger = DataLedger(10_000, SEQ)
    (a0,), (a1,), (a2,) = (ledger.lease("a", i, 10) for i in range(3))
    ledger.check("a", 0, [a0], 10 * SEQ)  # pushed on lease 0; lease 1 skipped (a lost round); on lease 2 now
    assert ledger.release("a", keep_current=True) == 10  # its lease ran out: it keeps lease 2 to go on with
    assert ledger.release("a") == 10  # it left: lease 2 goes back too; lease 0 was pushed, it stays
    account = ledger.account(0, [])
    assert account.returned == 20 * SEQ and account.lost == 10 * SEQ  # lease 0: pushed, never folded here
    assert _positions(ledger.lease("b", 0, 20)) == _positions([a1, a2])
