"""A model of the polled hand-off in ``stream_sentinel.patch`` (no GPU): every tile gets exactly
one folder (its last unit in the CTA holding its first), and the schedule finishes, consumer
warpgroups taking a CTA's units in turn through a ring of stages, each folder waiting until its
tile's partials are stored, CTAs started in order on however many SMs are free.

    python benchmarks/prepared/stream_sentinel_schedule.py

Prints every case that cannot finish (expected: only grids of several CTAs on one SM).
"""

import itertools


def folders(n_tiles: int, n_folds: int, ranges: list[tuple[int, int]]) -> dict[int, int]:
    """Tile -> the unit whose warpgroup folds it (the kernel's rule)."""
    found: dict[int, int] = {}
    for u0, u1 in ranges:
        for u in range(u0, u1):
            t0 = (u // n_folds) * n_folds
            if n_folds > 1 and t0 >= u0 and u == min(u1, t0 + n_folds) - 1:
                assert u // n_folds not in found, "two folders"
                found[u // n_folds] = u
    assert n_folds == 1 or set(found) == set(range(n_tiles)), "a tile without a folder"
    return found


def finishes(n_tiles: int, n_folds: int, grid: int, nwg: int, stages: int, sms: int) -> bool:
    """Whether the launch completes with ``sms`` CTAs resident at most."""
    units = n_tiles * n_folds
    ranges = [(b * units // grid, (b + 1) * units // grid) for b in range(grid)]
    folder = folders(n_tiles, n_folds, ranges)
    stored: set[int] = set()
    pos: dict[int, list[int]] = {}
    waiting: dict[int, list[int | None]] = {}
    running: list[int] = []
    started = 0
    while started < grid and len(running) < sms:
        pos[started], waiting[started] = [0] * nwg, [None] * nwg
        running.append(started)
        started += 1
    while running:
        progress = False
        for b in list(running):
            u0, u1 = ranges[b]
            for w in range(nwg):
                tile = waiting[b][w]
                if tile is not None:
                    if all(x in stored for x in range(tile * n_folds, (tile + 1) * n_folds)):
                        waiting[b][w], progress = None, True
                    continue
                i = w + nwg * pos[b][w]
                # unit i's stage is refilled once unit i - stages is computed
                if u0 + i >= u1 or (i >= stages and u0 + i - stages not in stored):
                    continue
                stored.add(u0 + i)
                pos[b][w] += 1
                progress = True
                if n_folds > 1 and folder[(u0 + i) // n_folds] == u0 + i:
                    waiting[b][w] = (u0 + i) // n_folds
            idle = all(u0 + w + nwg * pos[b][w] >= u1 for w in range(nwg))
            if idle and all(t is None for t in waiting[b]):
                running.remove(b)
                progress = True
                if started < grid:
                    pos[started], waiting[started] = [0] * nwg, [None] * nwg
                    running.append(started)
                    started += 1
        if not progress:
            return False
    return True


def main() -> None:
    cases = 0
    shapes = itertools.product(
        [1, 2, 3, 5, 16, 80, 128, 131], [1, 2, 4, 5, 16, 24], [1, 2, 3, 7, 66, 132], [2, 3], [5, 7]
    )
    for n_tiles, n_folds, grid, nwg, stages in shapes:
        grid = min(grid, -(-n_tiles * n_folds // nwg))
        for sms in sorted({grid, max(1, grid // 2), 3, 2, 1}):
            if sms <= grid:
                cases += 1
                if not finishes(n_tiles, n_folds, grid, nwg, stages, sms):
                    print("cannot finish:", n_tiles, n_folds, grid, nwg, stages, "SMs", sms)
    print(f"{cases} cases")


if __name__ == "__main__":
    main()
