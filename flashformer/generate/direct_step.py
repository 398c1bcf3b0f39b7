"""A compiled decode step called without dynamo's guard check on every token.

Before each call of a torch.compile'd function dynamo checks that the compiled
graph still fits its inputs: for the decode step that means every parameter's
shape and dtype, every module attribute the trace read, and the caches. For
SmolLM2-135M that is about 11,000 guards, about 1 ms of a 7-8 ms step on 2
AVX2 cores (docs/benchmarks.md, "The compiled step's guards"). Within one
decoding session almost nothing they look at can change: the model, its
parameters' shapes, the cache tensors, the batch and the global state are the
same at every step. What does change is the cache position (an int, symbolic
in the graph), the padding mask's length and the values of the tensors, which
no guard reads.

So a session lets its first steps go through dynamo (which compiles and
chooses a graph), then checks the guards itself, once, against two sets of
inputs: this step's and those of the session's last possible step (the highest
cache position, the longest mask). The guards dynamo puts on a symbolic
position are bounds from slicing the caches, `0 <= position`, `position + 1 <=
max_len`, and contiguity tests such as `max_len != position + 1`, which hold
at every position between two that pass. Where both checks pass, the rest of
the session calls the chosen graph's code directly, as vLLM does for its
compiled models; where either fails (or the cache holds no entry to choose), it
stays on dynamo's path. A step whose batch or cache objects differ from the
checked ones goes back to dynamo as well.

The cache entries are read with torch._dynamo's debug accessor: where a torch
has none, every step takes dynamo's path, with its guards, as before.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch


def _entries(function) -> list:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # another torch: no direct path
        return []
    return list(_debug_get_cache_entry_list(function.__code__))


def direct_call(function, now: tuple, last: tuple) -> Callable | None:
    """The compiled code of `function` (a torch.compile'd module-level function of positional
    arguments) whose guards pass for both `now` and `last` (its arguments at this step and at
    the session's last), callable with the same arguments without dynamo; None if no entry's
    do. The serving engine's step, whose inputs never change, passes the same twice."""
    code = function.__code__
    names = code.co_varnames[: code.co_argcount]
    now_locals, last_locals = dict(zip(names, now)), dict(zip(names, last))
    for entry in _entries(function):
        if entry.guard_manager.check(now_locals) and entry.guard_manager.check(last_locals):
            return types.FunctionType(entry.code, function.__globals__, function.__name__)
    return None


class DirectStep:
    """One session's decode step: dynamo's compiled call until direct_call finds a graph
    for the whole session (tried from the second step on, a few times: the first steps may
    compile), then that graph's code called directly, as long as the batch and the cache
    objects are those its guards were checked with."""

    ATTEMPTS = 3

    def __init__(self, step, compiled):
        self.step, self.compiled = step, compiled
        self.calls = 0
        self.direct: Callable | None = None
        self.checked: tuple | None = None  # (batch shape, id of each cache) the guards passed with

    def __call__(self, args: tuple, last: Callable[[], tuple]) -> torch.Tensor:
        """args: this step's arguments; last(): those of the session's last step."""
        key = (args[1].shape, tuple(map(id, args[4])))
        if self.direct is not None and key == self.checked:
            return self.direct(*args)
        out = self.compiled(*args)
        self.calls += 1
        if self.direct is None and 2 <= self.calls <= self.ATTEMPTS + 1:
            self.direct = direct_call(self.step, args, last())
            self.checked = key
        return out
