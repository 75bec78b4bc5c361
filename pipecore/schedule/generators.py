"""Schedule families: per-stage orders of forwards and backwards (updates are inserted afterwards).

Every generator takes ``(num_stages, n_microbatches, n_minibatches)`` and numbers micro-batches globally
from 0 (mini-batch ``j`` holds micro-batches ``j*m .. j*m+m-1``). The asynchronous families are prefix-stable:
the schedule for ``n`` mini-batches agrees with the one for ``n+1`` up to the first action that would
need a micro-batch of mini-batch ``n``; only the drain at the end differs. That is what lets a pipeline run
continuously across ``step()`` calls and drain on ``flush()``.
"""

from __future__ import annotations

from typing import Callable

from .ir import Action, B, F
from .schedule import Schedule

ScheduleFamily = Callable[[int, int, int], Schedule]


def _check_sizes(num_stages: int, n_microbatches: int, n_minibatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if n_minibatches < 1:
        raise ValueError(f"n_minibatches must be >= 1, got {n_minibatches}")


def _one_f_one_b_block(stage: int, num_stages: int, first: int, count: int, slack: int = 0) -> list[Action]:
    """Warm-up ``min((P-s-1)*(1+slack), count)`` forwards, then alternate F and B, then drain the backwards."""
    warmup = min((num_stages - stage - 1) * (1 + slack), count)
    actions = [Action(stage, F, first + k) for k in range(warmup)]
    for k in range(count - warmup):
        actions.append(Action(stage, F, first + k + warmup))
        actions.append(Action(stage, B, first + k))
    actions.extend(Action(stage, B, first + k) for k in range(count - warmup, count))
    return actions


def gpipe(num_stages: int, n_microbatches: int, n_minibatches: int = 1) -> Schedule:
    """GPipe: all forwards of a mini-batch, then all its backwards, then (after updates) a flush."""
    _check_sizes(num_stages, n_microbatches, n_minibatches)
    m = n_microbatches
    stages = []
    for s in range(num_stages):
        row: list[Action] = []
        for j in range(n_minibatches):
            row += [Action(s, F, j * m + u) for u in range(m)]
            row += [Action(s, B, j * m + u) for u in range(m)]
        stages.append(tuple(row))
    return Schedule(num_stages, m, n_minibatches, tuple(stages))


def one_f_one_b(num_stages: int, n_microbatches: int, n_minibatches: int = 1) -> Schedule:
    """1F1B with a flush after every mini-batch (PipeDream-Flush, Megatron's default)."""
    _check_sizes(num_stages, n_microbatches, n_minibatches)
    m = n_microbatches
    stages = []
    for s in range(num_stages):
        row: list[Action] = []
        for j in range(n_minibatches):
            row += _one_f_one_b_block(s, num_stages, j * m, m)
        stages.append(tuple(row))
    return Schedule(num_stages, m, n_minibatches, tuple(stages))


def async_one_f_one_b(num_stages: int, n_microbatches: int, n_minibatches: int = 1, slack: int = 0) -> Schedule:
    """1F1B without flushes: one warm-up at the start, one drain at the end (PipeDream, 2BW, PipeMare).

    ``slack`` adds that many forwards per downstream stage to each stage's warm-up (stage ``s`` runs
    ``(P-s-1)*(1+slack)`` forwards before its first backward). With ``slack=0`` a stage's next backward
    waits for a gradient that its neighbour produces just in time, so every message's latency lands on
    the critical path; each unit of slack gives a message one more forward+backward of the receiver to
    arrive in, for one more micro-batch of activations held per downstream stage.
    """
    _check_sizes(num_stages, n_microbatches, n_minibatches)
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise ValueError(f"slack must be a non-negative integer, got {slack!r}")
    total = n_microbatches * n_minibatches
    stages = tuple(tuple(_one_f_one_b_block(s, num_stages, 0, total, slack)) for s in range(num_stages))
    return Schedule(num_stages, n_microbatches, n_minibatches, stages)


def n_forward_one_backward(num_stages: int, n_microbatches: int, n_minibatches: int = 1) -> Schedule:
    """TiMePReSt's nF1B: a forward per micro-batch, one backward per mini-batch per stage.

    Generated with the slot rule that reproduces the TiMePReSt paper's figures: every action takes one
    slot and may use only results of earlier slots; in each slot a stage runs its next backward if ready,
    otherwise its next forward if the input is there and the stage holds fewer than ``P - s`` mini-batches
    in flight (PipeDream's admission cap).
    """
    _check_sizes(num_stages, n_microbatches, n_minibatches)
    P, m, n = num_stages, n_microbatches, n_minibatches
    total = m * n
    forward_slot = [[-1] * total for _ in range(P)]   # slot in which F(s, k) ran
    backward_slot = [[-1] * n for _ in range(P)]      # slot in which B(s, mini-batch j) ran
    next_forward = [0] * P
    next_backward = [0] * P
    rows: list[list[Action]] = [[] for _ in range(P)]
    slot = 0
    while any(nb < n for nb in next_backward):
        for s in range(P):
            j = next_backward[s]
            if j < n:
                last_mb = j * m + m - 1
                local_done = 0 <= forward_slot[s][last_mb] < slot
                remote_done = s == P - 1 or 0 <= backward_slot[s + 1][j] < slot
                if local_done and remote_done:
                    backward_slot[s][j] = slot
                    next_backward[s] += 1
                    rows[s].append(Action(s, B, j * m, m))
                    continue
            k = next_forward[s]
            if k >= total:
                continue
            input_ready = s == 0 or 0 <= forward_slot[s - 1][k] < slot
            minibatch = k // m
            admitted = k % m != 0 or minibatch - next_backward[s] < P - s
            if input_ready and admitted:
                forward_slot[s][k] = slot
                next_forward[s] += 1
                rows[s].append(Action(s, F, k))
        slot += 1
        if slot > 4 * (total + n) * P + 16:  # the rule always progresses; this guards future edits
            raise RuntimeError("nF1B slot rule made no progress; this is a bug in the generator")
    return Schedule(P, m, n, tuple(tuple(r) for r in rows))


FAMILIES: dict[str, ScheduleFamily] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "async-1f1b": async_one_f_one_b,
    "nf1b": n_forward_one_backward,
}
