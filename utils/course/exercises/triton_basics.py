"""Checks for notebook 00's exercises (program ids, launch grids)."""
from __future__ import annotations

from itertools import product

from utils.triton_utils import test_pid_conds


def check_condition_string(conds: str) -> None:
    """Exercise 0.1: `conds` must select exactly the programs with pid_0 == 0 and pid_1 >= 2, whatever pid_2.

    Every program of a 3 x 5 x 3 grid is tried, all three ids varying, so an entry that pins pid_2 fails."""
    if not isinstance(conds, str):
        raise AssertionError(f"return a str such as '=1,<3', got {type(conds).__name__}")
    grid = list(product(range(3), range(5), range(3)))
    chosen = {pids for pids in grid if test_pid_conds(conds, *pids)}
    wanted = {(p0, p1, p2) for p0, p1, p2 in grid if p0 == 0 and p1 >= 2}
    if chosen != wanted:
        extra, missing = sorted(chosen - wanted), sorted(wanted - chosen)
        raise AssertionError(f"{conds!r} also selects (pid_0, pid_1, pid_2) = {extra[:4]}" if extra else
                             f"{conds!r} misses (pid_0, pid_1, pid_2) = {missing[:4]}")
