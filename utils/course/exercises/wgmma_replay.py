"""Exercise 6c.5: one trip of the Hopper attention kernel's overlapped consumer loop, replayed on the CPU.

The learner writes the order of events for tile i (i >= 1) of the loop in which tile i's S = Q Kᵢᵀ and tile
i-1's O += P V run together, tile i's softmax under the second (hopper_attention_kernel.cuh, the `tile` lambda
of step "overlap"). Each event is a string:

    "wait full T"      wait until tile T's K and Vᵀ have landed in their stage
    "issue S T"        wgmma S = Q K_Tᵀ (reads tile T's K stage; writes the S accumulator)
    "issue PV T"       wgmma O += P_T V_T (reads P_T from registers and tile T's Vᵀ stage; writes O)
    "commit"           close a group of the wgmmas issued since the last commit
    "wait N"           wgmma.wait_group N: block until at most N committed groups are in flight
    "softmax T"        read S (tile T's scores), write P_T and the factor alpha_T
    "rescale"          O *= alpha of the last softmax
    "arrive empty T"   tell the producer that tile T's stage is free

where T is "i", "i-1", "i-2" or "i+1". `replay_trip` runs the checker's prologue (tile 0's S and softmax), the
learner's trip for tiles 1 .. n-1 and the epilogue (the last P V), against a model of the wgmma groups in flight,
the K/V stages and the accumulators, and raises AssertionError naming the first hazard: the tile, the event and
the stage or accumulator it concerns.
"""
from __future__ import annotations

import re

__all__ = ["kernel_trip", "replay_trip", "check_consumer_trip"]
_EVENT = re.compile(r"^(wait full|issue S|issue PV|softmax|arrive empty) i(?:([+-])([12]))?$|^(commit|rescale)$"
                    r"|^wait ([0-9])$")


def kernel_trip() -> list[str]:
    """The order the course's kernel uses (hopper_attention_kernel.cuh, step "overlap"): the exercise's answer."""
    return ["wait full i", "issue S i", "commit", "issue PV i-1", "commit", "wait 1", "softmax i", "wait 0",
            "arrive empty i-1", "rescale"]


def _parse(event, i: int):
    """(kind, tile) of one event string for trip i; tile is None for commit, rescale and wait N."""
    if not isinstance(event, str):
        raise TypeError(f"each event is a string such as 'commit', got {type(event).__name__} {event!r}")
    m = _EVENT.match(" ".join(event.split()))
    if not m:
        raise AssertionError(f"unknown event {event!r}: the events are 'wait full T', 'issue S T', 'issue PV T', "
                             "'commit', 'wait N', 'softmax T', 'rescale' and 'arrive empty T', T one of i, i-1, "
                             "i-2, i+1")
    if m.group(1):
        offset = int(m.group(3) or 0) * (-1 if m.group(2) == "-" else 1)
        return m.group(1), i + offset
    if m.group(4):
        return m.group(4), None
    return "wait", int(m.group(5))


def replay_trip(trip, n_tiles: int, stages: int) -> None:
    """Replay prologue, `trip` (a list of event strings) for tiles 1 .. n_tiles-1, epilogue; raise AssertionError
    at the first hazard. The producer refills tile t's stage with tile t + stages once t's stage is released."""
    if isinstance(trip, str) or not isinstance(trip, (list, tuple)):
        raise TypeError(f"the trip is a list of event strings, got {type(trip).__name__}")
    if not isinstance(n_tiles, int) or n_tiles < 1:
        raise ValueError(f"n_tiles must be a positive int, got {n_tiles!r}")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages!r}")
    waited, released = set(), set()      # tiles whose copy the consumer saw land; tiles whose stage it freed
    groups: list[list] = []              # committed groups in flight, oldest first: each a list of wgmmas
    open_group: list = []                # issued since the last commit
    state = {"S": None, "P": set(), "alpha": None, "O_tiles": 0, "O_scale": 0}

    def in_flight():
        return [w for g in groups for w in g] + open_group

    def run(event, i, where):
        kind, t = _parse(event, i)
        at = f"{where}, '{event}'"
        if t is not None and not 0 <= t < n_tiles:
            raise AssertionError(f"{at}: there is no tile {t} (tiles 0 to {n_tiles - 1})")
        if kind == "wait full":
            earlier = t - stages
            if earlier >= 0 and earlier not in released:
                raise AssertionError(f"{at}: hangs. Tile {t} goes into stage {t % stages}, which tile {earlier} "
                                     f"still holds: its stage was never released, so the copy never comes")
            waited.add(t)
        elif kind in ("issue S", "issue PV"):
            what = "K" if kind == "issue S" else "Vᵀ"
            if t not in waited:
                raise AssertionError(f"{at}: reads tile {t}'s {what} in stage {t % stages} before waiting for "
                                     "its copy to land")
            if t in released:
                raise AssertionError(f"{at}: reads tile {t}'s {what} in stage {t % stages}, already released: "
                                     "the producer may be writing the next tile there")
            if kind == "issue S":
                pending = [w for w in in_flight() if w[0] == "S"]
                if pending:
                    raise AssertionError(f"{at}: S of tile {pending[0][1]} is still being written by a wgmma "
                                         "in flight")
                if state["S"] is not None:
                    raise AssertionError(f"{at}: overwrites tile {state['S']}'s scores before its softmax read "
                                         "them")
                open_group.append(("S", t))
                state["S"] = ("pending", t)
            else:
                if t not in state["P"]:
                    raise AssertionError(f"{at}: P of tile {t} does not exist yet (its softmax has not run)")
                if state["O_tiles"] != t:
                    raise AssertionError(f"{at}: O holds tiles 0 to {state['O_tiles'] - 1}; P V must add tile "
                                         f"{state['O_tiles']} first, the tiles in order")
                if state["O_scale"] != t:
                    raise AssertionError(f"{at}: O is scaled for tile {state['O_scale']}'s running maximum, but "
                                         f"P of tile {t} is scaled for tile {t}'s")
                open_group.append(("PV", t))
                state["O_tiles"] = t + 1
        elif kind == "commit":
            if not open_group:
                raise AssertionError(f"{at}: commits an empty group (no wgmma issued since the last commit)")
            groups.append(list(open_group))
            open_group.clear()
        elif kind == "wait":
            if open_group:
                raise AssertionError(f"{at}: the wgmma '{open_group[0][0]} {open_group[0][1]}' was issued but "
                                     "not committed: wait_group does not wait for it")
            del groups[:max(0, len(groups) - t)]
        elif kind == "softmax":
            busy = [w for w in in_flight() if w[0] == "S"]
            if busy:
                raise AssertionError(f"{at}: reads S while the wgmma writing tile {busy[0][1]}'s scores is in "
                                     "flight (wait_group N retires all but the N newest groups)")
            if state["S"] != ("pending", t):
                raise AssertionError(f"{at}: S holds tile {state['S'][1] if state['S'] else 'none'}'s scores, "
                                     f"not tile {t}'s")
            if not in_flight() and t > 0:
                raise AssertionError(f"{at}: no wgmma is in flight while the softmax runs, so the tensor cores "
                                     f"idle through it; keep tile {t - 1}'s P V running underneath")
            state["S"] = None
            state["P"].add(t)
            state["alpha"] = t
        elif kind == "rescale":
            busy = [w for w in in_flight() if w[0] == "PV"]
            if busy:
                raise AssertionError(f"{at}: rescales O while the P V of tile {busy[0][1]} still accumulates "
                                     "into it")
            if state["alpha"] is None or state["alpha"] == state["O_scale"]:
                raise AssertionError(f"{at}: no new factor alpha since the last rescale (run the softmax first)")
            if state["O_tiles"] != state["alpha"]:
                raise AssertionError(f"{at}: alpha of tile {state['alpha']} applied to O holding tiles 0 to "
                                     f"{state['O_tiles'] - 1}; it belongs on the tiles before tile "
                                     f"{state['alpha']}")
            state["O_scale"] = state["alpha"]
        else:   # arrive empty
            if t in released:
                raise AssertionError(f"{at}: tile {t}'s stage released twice")
            if t not in waited:
                raise AssertionError(f"{at}: releases tile {t}'s stage before its copy landed")
            busy = [w for w in in_flight() if w[1] == t]
            if busy:
                raise AssertionError(f"{at}: releases stage {t % stages} while the wgmma '{busy[0][0]} {t}' "
                                     "still reads it; the producer may overwrite it mid-read")
            if t == state["O_tiles"]:
                raise AssertionError(f"{at}: releases stage {t % stages} before tile {t}'s wgmmas have read it")
            released.add(t)

    for event in ("wait full i", "issue S i", "commit", "wait 0", "softmax i"):
        run(event, 0, "the prologue, tile 0")
    for i in range(1, n_tiles):
        for event in trip:
            run(event, i, f"tile {i}")
    for event in ("issue PV i", "commit", "wait 0", "arrive empty i"):
        run(event, n_tiles - 1, f"the epilogue, tile {n_tiles - 1}")
    missing = sorted(set(range(n_tiles)) - released)
    if missing:
        raise AssertionError(f"tile {missing[0]}'s stage is never released: the producer waits forever")


def check_consumer_trip(fn) -> None:
    """Exercise 6c.5: fn() returns the event list of one trip; replayed for 1-6 tiles and 2-4 stages, with the
    course's own order switched off."""
    from utils.course.exercises.refuse import refusing

    if not callable(fn):
        raise TypeError(f"pass your function, got {type(fn).__name__}")
    with refusing(kernel_trip):
        trip = fn()
    for stages in (2, 3, 4):
        for n_tiles in range(1, 7):
            try:
                replay_trip(trip, n_tiles, stages)
            except AssertionError as err:
                raise AssertionError(f"{n_tiles} tiles, {stages} stage{'s' * (stages > 1)}: {err}") from None
