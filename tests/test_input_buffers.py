"""The runner's persistent rows (`InputBuffers`, 12d_runner) against tables rebuilt from scratch every step.

The runner rewrites a request's block-table row only when its snapshot is new, and copies only the rows rewritten
since the last step into the last step's gathered tables: the obviously right form builds every table again from the
snapshots. Random steps (requests started, restarted, released, their tables growing or not, groups changing apart)
must give the same tables either way."""
import random
import numpy as np
import pytest
from dsv41_nb.block_pool import NULL_BLOCK_ID
from dsv41_nb.runner import InputBuffers, RING

GROUPS = ('swa', 'global', 'c4')


def rebuilt(snaps: list) -> list:
    "Per group, (R, widest) int32 tables of the snapshots, padded with the null block: built from nothing"
    out = []
    for g in range(len(GROUPS)):
        w = max((len(s[g]) for s in snaps), default=0)
        t = np.full((len(snaps), w), NULL_BLOCK_ID, dtype=np.int32)
        for i, s in enumerate(snaps): t[i, :len(s[g])] = s[g]
        out.append(t)
    return out


def same_tables(got: list, want: list) -> bool:
    "Equal where `want` has columns; `got` may be wider (kept from a wider step), its extra columns null"
    return all(g.shape[0] == w.shape[0] and g.shape[1] >= w.shape[1] and (g[:, :w.shape[1]] == w).all()
               and (g[:, w.shape[1]:] == NULL_BLOCK_ID).all() for g, w in zip(got, want))


def run(seed: int, steps: int = 300):
    rng, buf = random.Random(seed), InputBuffers(GROUPS, rows=2)
    live, snap, nxt = {}, {}, [1]
    def grow(s, g):                       # a new snapshot: group g one block longer
        new = list(s); new[g] = s[g] + (nxt[0],); nxt[0] += 1
        return tuple(new)
    for step in range(steps):
        for rid in [r for r in live if rng.random() < 0.08]:          # finished or preempted
            buf.release([rid]); del live[rid]
        for _ in range(rng.randrange(3)):                              # (re)started
            rid = f'r{rng.randrange(12)}'
            if rid in live: continue
            live[rid] = buf.start(rid, [1, 2, 3], 0)
            snap[rid] = tuple(tuple(nxt[0] + i for i in range(rng.randrange(3))) for _ in GROUPS)
            nxt[0] += 3
        ids = sorted(live) if rng.random() < 0.5 else rng.sample(sorted(live), len(live))
        if not ids: continue
        for rid in ids:
            if rng.random() < 0.3: snap[rid] = grow(snap[rid], rng.randrange(len(GROUPS)))
            elif rng.random() < 0.05: snap[rid] = tuple(snap[rid])     # an equal snapshot, a new object
        rows = buf.assign(ids, [snap[r] for r in ids])
        assert [int(r) for r in rows] == [live[r] for r in ids], step
        assert same_tables(buf.tables_of(rows), rebuilt([snap[r] for r in ids])), (seed, step)
        if rng.random() < 0.5:                                         # the same step again, nothing new
            assert buf.assign(ids, [snap[r] for r in ids]) is rows
            assert same_tables(buf.tables_of(rows), rebuilt([snap[r] for r in ids])), (seed, step)


@pytest.mark.parametrize('seed', range(6))
def test_rows_and_tables_equal_a_rebuild(seed):
    run(seed)


def test_a_table_that_narrows_keeps_null_past_its_end():
    "A restarted request whose table is shorter than the row's last: the old blocks past its end are gone"
    buf = InputBuffers(GROUPS, rows=1)
    buf.start('a', [1], 0)
    rows = buf.assign(['a'], [((5, 6, 7), (8,), ())])
    buf.tables_of(rows)
    buf.start('a', [1], 0)                                             # restarted: a new, shorter table
    rows = buf.assign(['a'], [((9,), (8,), ())])
    t = buf.tables_of(rows)
    assert t[0].tolist()[0][:1] == [9] and set(t[0][0, 1:].tolist()) <= {NULL_BLOCK_ID}


def test_history_is_the_ids_before_each_position():
    "The H ids before each position, read from the rows' rings, against the requests' whole id lists (-1 before 0)"
    rng, buf = random.Random(0), InputBuffers(GROUPS, rows=4)
    seqs = {f'r{i}': [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 30))] for i in range(6)}
    def check():
        rows = np.array([buf.row_of[rid] for rid in seqs])
        for H in (1, 2, 3):
            for _ in range(20):
                pos = np.array([rng.randrange(max(0, len(s) - RING + H), len(s) + 1) for s in seqs.values()])
                want = [[s[p - H + j] if p - H + j >= 0 else -1 for j in range(H)]
                        for s, p in zip(seqs.values(), pos)]
                assert buf.history(rows, pos, H).tolist() == want, (H, pos)
    for rid, s in seqs.items(): buf.start(rid, s, 0)
    check()
    assert buf.history(np.zeros(0, np.int64), np.zeros(0, np.int64), 2).shape == (0, 2)   # a step without rows
    # rows given back and taken by new requests with short sequences: the old ids in their rings stay unread
    buf.release(list(seqs)[:3])
    for i in range(3): seqs.pop(f'r{i}'); seqs[f'n{i}'] = [rng.randrange(1, 1000) for _ in range(i + 1)]
    for rid in list(seqs)[-3:]: buf.start(rid, seqs[rid], 0)
    check()


def test_settle_takes_ids_only_for_rows_still_their_own():
    "A step's sampled ids go to the rows whose request still holds them (same generation); others keep theirs"
    buf = InputBuffers(GROUPS, rows=4)
    a, b, c = (buf.start(r, [1, 2, 3], 0) for r in 'abc')
    rows = np.array([a, b, c]); gens = buf.gen[rows].copy()
    buf.late_step[rows] = [7, 7, 6]                     # a and b wait for step 7's ids, c for step 6's
    buf.release(['b'])                                   # b's row is no longer b's
    ring_b = buf.ring[b].copy()
    buf.settle(rows, np.array([3, 3, 3]), [41, 42, 43], gens, step=7)
    assert buf.ring[a, 3 % RING] == 41 and buf.ntok[a] == 4
    assert buf.ring[c, 3 % RING] == 43 and buf.ntok[c] == 4
    assert (buf.ring[b] == ring_b).all() and buf.ntok[b] == 3
    assert buf.late_step[a] == -1 and buf.late_step[c] == 6 and buf.late_step[b] == -1
