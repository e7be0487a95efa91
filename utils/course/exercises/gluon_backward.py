"""Exercise 7.7 (worklog 07w, section 5): the synchronisation of the warp-specialised Gluon backward, written by the
learner as data and replayed on the CPU by utils.explicit.backward.replay.

The learner's function `fn(t, stages)` returns (producer steps, consumer steps) for tile t, in the vocabulary of
utils.explicit.backward.STEPS: the waits on the ring's full and empty mbarriers with their parities, the copy,
the products, the wait for the TMA engine, the meeting of the two consumers, the dQ block and the release of
the slot. The check replays it in many random interleavings and names the first hazard: the partition, the tile,
and the slot or buffer.
"""
from __future__ import annotations

import itertools

from utils.course.exercises.refuse import refusing
from utils.explicit import backward as gbwd

__all__ = ["check_backward_protocol"]


def check_backward_protocol(fn, *, seeds: int = 20) -> None:
    """Exercise 7.7: replay fn's protocol for 0-8 tiles, 1-3 stages and `seeds` interleavings each, with the
    course's own protocol switched off."""
    if not callable(fn):
        raise TypeError(f"pass your function, got {type(fn).__name__}")

    def protocol(t, n_tiles, stages):
        steps = fn(t, stages)
        if not isinstance(steps, tuple) or len(steps) != 2:
            raise AssertionError(f"tile {t}: return (producer steps, consumer steps), got {steps!r}")
        return steps

    with refusing(gbwd.kernel_protocol, gbwd._kernel_tile, gbwd.replay_protocol):
        for stages, n_tiles, seed in itertools.product((1, 2, 3), range(9), range(seeds)):
            try:
                gbwd.replay(protocol, n_tiles, stages, seed)
            except AssertionError as err:
                raise AssertionError(f"{n_tiles} tile{'s' * (n_tiles != 1)}, {stages} stage{'s' * (stages > 1)}"
                                     f" (interleaving {seed}): {err}") from None
