"""The CrossHair contract wrappers (proofs/contracts.py, reference/contracts.py): concrete runs of
each wrapper with its postconditions, and CrossHair finding planted bugs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvspec.proofs import contracts as sc
from kvspec.reference import contracts as rc

# (n, free, refs, keys): block 1 cached and free, 2 held twice, 3 held and cached under the same
# key as 1, 4 free and uncached.
STATE = (5, [4, 1], [0, 0, 2, 1, 0], [0, 2, 0, 2, 0])
EMPTY = (3, [1, 2], [0, 0, 0], [0, 0, 0])
FULL = (4, [], [0, 1, 1, 1], [0, 1, 0, 3])


@pytest.mark.parametrize("state", [STATE, EMPTY, FULL])
def test_consistent_states(state: tuple) -> None:
    assert sc.consistent(*state) and rc.consistent(*state)


def test_inconsistent_states_are_rejected() -> None:
    for bad in [
        (5, [4], [0, 0, 2, 1, 0], [0, 2, 0, 2, 0]),  # block 1 unreferenced but not queued
        (5, [4, 4], [0, 1, 2, 1, 0], [0, 2, 0, 2, 0]),  # a block queued twice
        (5, [4, 1, 2], [0, 0, 2, 1, 0], [0, 2, 0, 2, 0]),  # a referenced block queued
        (3, [1, 2], [1, 0, 0], [0, 0, 0]),  # the null block referenced
    ]:
        assert not sc.consistent(*bad) and not rc.consistent(*bad)


def test_allocate() -> None:
    for state in [STATE, EMPTY]:
        block, evicted, p = sc.allocate(*state)
        assert sc.pool_ok(p) and sc.allocate_effect(*state, block, evicted, p)
        rblock, rp = rc.allocate(*state)
        assert rp.links_ok and rc.allocate_effect(*state, rblock, rp)
        assert rblock == block == state[1][0] and rp.free == p.free
    block, evicted, p = sc.allocate(*STATE)
    assert (block, evicted, p.free) == (4, False, [1])
    block, evicted, p = sc.allocate(5, [1, 4], *STATE[2:])  # the cached head is evicted
    assert (block, evicted, p.keys[1], p.owners) == (1, True, None, [((1, 2), [3])])


def test_free_table() -> None:
    # 3 (cached) and 2 (held twice) freed: 3 goes to the tail, 2 stays referenced.
    p = sc.free_table(*STATE, [2, 3])
    assert sc.pool_ok(p) and sc.free_table_effect(*STATE, [2, 3], p)
    assert p.free == [4, 1, 3] and p.refs == [0, 0, 1, 0, 0]
    rp = rc.free_reversed(*STATE, [2, 3])
    assert rp.links_ok and rc.free_reversed_effect(*STATE, [2, 3], rp) and rp.free == p.free
    # uncached blocks go to the head in table order, cached ones to the tail in reverse order
    p = sc.free_table(*FULL, [1, 2, 3])  # 2 uncached; 1 and 3 cached
    assert p.free == [2, 3, 1] and sc.pool_ok(p)
    p = sc.free_table(4, [], [0, 1, 1, 1], [0, 1, 2, 0], [1, 2, 3])
    assert p.free == [3, 2, 1] and sc.pool_ok(p)
    assert rc.free_reversed(4, [], [0, 1, 1, 1], [0, 1, 2, 0], [1, 2, 3]).free == [3, 2, 1]


def test_touch() -> None:
    table, p = sc.touch(*STATE, [1, 3])
    assert table == [1, 3] and p.free == [4] and p.refs == [0, 1, 2, 2, 0]
    assert sc.pool_ok(p) and sc.touch_effect(*STATE, [1, 3], table, p)
    rp = rc.touch(*STATE, [1, 3])
    assert rp.links_ok and rc.touch_effect(*STATE, [1, 3], rp) and rp.free == p.free


def test_publish_and_unpublish() -> None:
    registered, p = sc.publish(*STATE, [2, 3], [7, 8, 9], 0)
    assert registered and p.keys[2] == (7,) and sc.pool_ok(p)
    assert sc.publish_effect(*STATE, 2, (7,), registered, p)
    registered, p = sc.publish(*STATE, [2, 3], [7, 8, 9], 1)  # 3 already carries a hash
    assert not registered and p.keys[3] == (1, 2)
    rp = rc.publish(*STATE, 2, 2)  # joins block 1 and 3 under hash 2, last
    assert rp.links_ok and rp.owners == [(2, [1, 3, 2])]
    assert rc.publish_effect(*STATE, 2, 2, rp)
    p = sc.unpublish(*STATE, 1)
    assert p.keys[1] is None and p.owners == [((1, 2), [3])] and sc.pool_ok(p)
    assert sc.unpublish_effect(*STATE, 1, p)
    rp = rc.evict(*STATE, 1)
    assert rp.links_ok and rp.owners == [(2, [3])] and rc.evict_effect(*STATE, 1, rp)
    assert sc.unpublish(*STATE, 4) == sc.snapshot(sc.build(*STATE))  # nothing to roll back


def test_lookup() -> None:
    state = (5, [1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 2, 1, 3, 1])
    assert sc.lookup(*state, [1, 2, 3, 4]) == [2, 1, 3]  # lowest id per key
    assert sc.lookup(*state, [1, 2, 3]) == [2, 1]  # capped: the last token is recomputed
    assert sc.lookup(*state, [1, 5, 3, 4]) == [2]  # stops at the first miss
    assert sc.lookup(*state, [2, 2]) == []
    for tokens in ([1, 2, 3, 4], [1, 2], [1, 5, 3, 4], [2]):
        assert sc.lookup_effect(state[3], tokens, sc.lookup(*state, tokens))


def test_free_then_allocate_agree() -> None:
    cases = [
        (*STATE, [2, 3], 2),
        (*FULL, [1, 2, 3], 3),
        (4, [], [0, 1, 1, 1], [0, 1, 2, 0], [1, 2, 3], 4),
        (*EMPTY, [], 1),
    ]
    for case in cases:
        assert sc.free_then_allocate(*case) == rc.free_then_allocate(*case) is not None
    assert sc.free_then_allocate(*STATE, [2, 3], 2) == (
        [4, 1],
        [3],
        [0, 1, 1, 0, 1],
        [False, False, False, True, False],
    )
    bad = (5, [4], [0, 0, 2, 1, 0], [0, 2, 0, 2, 0], [], 1)
    assert sc.free_then_allocate(*bad) is None and rc.free_then_allocate(*bad) is None


MUTANTS = '''
from kvspec.reference.block_pool import FreeBlockQueue
from kvspec.reference.contracts import Pool as RPool
from kvspec.reference.contracts import build as rbuild, consistent as rconsistent, snapshot as rsnapshot
from kvspec.proofs.contracts import Pool, build, consistent, free_table_effect, snapshot, table_ok


def cached_to_head(n: int, free: list, refs: list, keys: list, table: list) -> Pool:
    """The spec's free_table with a bug: every freed block goes to the queue's head.

    pre: consistent(n, free, refs, keys)
    pre: table_ok(n, refs, table)
    post: free_table_effect(n, free, refs, keys, table, __return__)
    """
    s = build(n, free, refs, keys)
    for block in reversed(table):
        s.blocks[block].refcount -= 1
        if s.blocks[block].refcount == 0:
            s.free.insert(0, block)
    return snapshot(s)


class LeakyQueue(FreeBlockQueue):
    __slots__ = ()

    def remove(self, block):
        block.prev.next = block.next
        block.next.prev = block.prev
        self.num_free -= 1  # bug: the removed block keeps its stale links


def stale_links(n: int, free: list, refs: list, keys: list, blocks: list) -> RPool:
    """The reference's touch over a queue whose remove leaves stale links.

    pre: rconsistent(n, free, refs, keys)
    pre: len(set(blocks)) == len(blocks) and all(0 < b < n for b in blocks)
    post: __return__.links_ok
    """
    bp = rbuild(n, free, refs, keys)
    bp.free_queue.__class__ = LeakyQueue
    bp.touch([bp.blocks[b] for b in blocks])
    return rsnapshot(bp)
'''


def crosshair_check(
    tmp_path: Path, name: str, source: str, seconds: int
) -> tuple[int, list[str], str]:
    """Run ``crosshair check`` on ``source`` written to a file; return the exit code, the error
    lines and the whole output. crosshair's search is randomized and its timeout is per
    condition: budgets are generous, since a loaded CI machine needs more, and a found bug ends
    its condition early."""
    target = tmp_path / name
    target.write_text(textwrap.dedent(source))
    crosshair = Path(sys.executable).with_name("crosshair")
    result = subprocess.run(
        [str(crosshair), "check", "--per_condition_timeout", str(seconds), str(target)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    return result.returncode, errors, result.stdout + result.stderr


def test_crosshair_finds_planted_bugs(tmp_path: Path) -> None:
    code, errors, out = crosshair_check(tmp_path, "mutants.py", MUTANTS, 60)
    assert code == 1, out
    assert any("cached_to_head" in e for e in errors), out
    assert any("stale_links" in e for e in errors), out


# diffbehavior on the list-shaped free_then_allocate pair finds no difference, but it does not
# find a planted one either (see docs/proofs.md). The same pair behind scalar inputs, compared by
# a `crosshair check` postcondition, does: this is the agreement check that is run.
AGREEMENT = '''
from itertools import permutations

from kvspec.reference import contracts as rc
from kvspec.proofs import contracts as sc

PERMS = list(permutations((1, 2, 3)))


def flat(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k):
    """Blocks 1..3 with refcounts r, cached flags c (1 and 2 share a key), the free queue in the
    order of permutation p, the table: the blocks chosen by t that are referenced, in the order
    of permutation q; allocate k."""
    refs = [0, r1, r2, r3]
    keys = [0, 1 if c1 else 0, 1 if c2 else 0, 2 if c3 else 0]
    free = [b for b in PERMS[p] if refs[b] == 0]
    chosen = {1: t1, 2: t2, 3: t3}
    table = [b for b in PERMS[q] if chosen[b] and refs[b] >= 1]
    return 4, free, refs, keys, table, k


def spec_side(r1: int, r2: int, r3: int, c1: bool, c2: bool, c3: bool, p: int, q: int, t1: bool, t2: bool, t3: bool, k: int):
    return sc.free_then_allocate(*flat(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k))


def ref_side(r1: int, r2: int, r3: int, c1: bool, c2: bool, c3: bool, p: int, q: int, t1: bool, t2: bool, t3: bool, k: int):
    return rc.free_then_allocate(*flat(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k))


def mutant_side(r1: int, r2: int, r3: int, c1: bool, c2: bool, c3: bool, p: int, q: int, t1: bool, t2: bool, t3: bool, k: int):
    """The reference with every freed block put at the queue's head."""
    n, free, refs, keys, table, k = flat(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k)
    refs = list(refs)
    for b in reversed(table):
        refs[b] -= 1
        if refs[b] == 0:
            free = [b] + free
    return rc.free_then_allocate(n, free, refs, keys, [], k)


def spec_agrees(r1: int, r2: int, r3: int, c1: bool, c2: bool, c3: bool, p: int, q: int, t1: bool, t2: bool, t3: bool, k: int):
    """
    pre: 0 <= r1 <= 2 and 0 <= r2 <= 2 and 0 <= r3 <= 2 and 0 <= p < 6 and 0 <= q < 6 and 0 <= k <= 3
    post: __return__ is not None and __return__ == ref_side(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k)
    """
    return spec_side(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k)


def mutant_agrees(r1: int, r2: int, r3: int, c1: bool, c2: bool, c3: bool, p: int, q: int, t1: bool, t2: bool, t3: bool, k: int):
    """
    pre: 0 <= r1 <= 2 and 0 <= r2 <= 2 and 0 <= r3 <= 2 and 0 <= p < 6 and 0 <= q < 6 and 0 <= k <= 3
    post: __return__ == ref_side(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k)
    """
    return mutant_side(r1, r2, r3, c1, c2, c3, p, q, t1, t2, t3, k)
'''


def test_crosshair_spec_and_reference_agree(tmp_path: Path) -> None:
    """Free a table then allocate: the spec and the reference give the same allocations, free
    queue, refcounts and cached blocks (no counterexample in 30 s), while a planted difference
    is found."""
    code, errors, out = crosshair_check(tmp_path, "agreement.py", AGREEMENT, 30)
    assert code == 1, out
    assert any("mutant_agrees" in e for e in errors), out
    assert not any("spec_agrees" in e for e in errors), out
