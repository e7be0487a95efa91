"""Switch off the course's own answers while a check runs the learner's function.

`with refusing(flash2_attention, naive_attention):` makes every call of those functions raise `RefusedAnswer`
(an AssertionError, so a check reports it as wrong) until the block ends, then restores them, also on error.

It swaps each function's `__code__`, not a module attribute: a name bound before the check, such as
`from utils.eager.forward import flash2_attention` in a notebook, a method reached through its class, or a
course module calling it internally, all hold the same function object, so all of them refuse. A function the
learner's own code only defines in the notebook (an earlier cell's helper) is refused by name through
`names=` and the learner function's globals.
"""
from __future__ import annotations

import functools
import types
from contextlib import contextmanager

__all__ = ["RefusedAnswer", "refusing", "refused_name"]

_CALLS: list[list[str]] = []     # one list per active `refusing` block: the refused names that were called


class RefusedAnswer(AssertionError):
    """A course function that answers the exercise was called while its check ran."""


def refused_name(fn) -> str:
    """'utils.eager.softmax.logsumexp' for a course function; the bare name for one defined in a notebook."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    return name if module in (None, "__main__", "builtins") else f"{module}.{name}"


def _message(name: str) -> str:
    return (f"the check refuses the course's own `{name}`: it answers this exercise, so it is switched off "
            f"while your function runs; write the step with your own code")


def _refuse(name: str) -> RefusedAnswer:
    """Called by a refused function's stand-in code: record the call, return the error it raises."""
    for calls in _CALLS:
        calls.append(name)
    return RefusedAnswer(_message(name))


def _function(obj) -> types.FunctionType:
    """The plain Python function behind `obj` (a function, method, staticmethod or classmethod)."""
    obj = getattr(obj, "__func__", obj)          # bound methods, staticmethod and classmethod objects
    if not isinstance(obj, types.FunctionType):
        raise TypeError(f"refusing() takes Python functions, got {type(obj).__name__} {obj!r}")
    return obj


def _stand_in(fn: types.FunctionType) -> types.CodeType:
    """A code object that raises RefusedAnswer naming `fn`, with as many free variables as fn's closure
    (a function's code can only be swapped for one with the same count)."""
    return _stand_in_code(refused_name(fn), len(fn.__code__.co_freevars))


@functools.lru_cache(maxsize=None)
def _stand_in_code(name: str, n_free: int) -> types.CodeType:
    free = [f"_free{i}" for i in range(n_free)]
    lines = ["def _outer():", *(f"    {v} = None" for v in free), "    def _refused(*args, **kwargs):"]
    if free:
        lines.append(f"        {', '.join(free)}")      # used, so they are free variables of _refused
    # `__import__` works from whatever globals fn runs in: a course module's or a notebook's.
    lines += [f"        raise __import__('utils.course.exercises.refuse', fromlist=['_refuse'])._refuse({name!r})",
              "    return _refused"]
    scope: dict = {}
    exec(compile("\n".join(lines), f"<refused {name}>", "exec"), scope)
    return scope["_outer"]().__code__


@contextmanager
def refusing(*answers, names=(), scope=None):
    """While the block runs, each function of `answers`, and each name of `names` that `scope` (a dict of
    globals, usually the learner's function's `__globals__`) binds to a function, raises RefusedAnswer naming
    it. If the learner's code catches that error, the block still fails when it ends."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a sequence of str, got {names!r}")
    if scope is not None and not isinstance(scope, dict):
        raise TypeError(f"scope must be a dict of globals, got {type(scope).__name__}")
    found = [_function(a) for a in answers]
    for name in names:
        obj = (scope or {}).get(name)
        if isinstance(obj, (types.FunctionType, types.MethodType, staticmethod, classmethod)):
            found.append(_function(obj))
    saved = []
    calls: list[str] = []
    _CALLS.append(calls)
    try:
        for fn in dict.fromkeys(found):          # once each, in order
            saved.append((fn, fn.__code__))
            fn.__code__ = _stand_in(fn)
        yield
    except RefusedAnswer:
        raise
    except Exception as err:
        if calls:                                # the learner's code turned the refusal into another error
            raise RefusedAnswer(_message(calls[0])) from err
        raise
    finally:
        for fn, code in reversed(saved):
            fn.__code__ = code
        del _CALLS[next(i for i, c in enumerate(_CALLS) if c is calls)]
    if calls:                                    # refused, but the learner's code swallowed the error
        raise RefusedAnswer(_message(calls[0]))
