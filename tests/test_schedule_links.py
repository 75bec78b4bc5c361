"""How far a sender can get ahead of its receiver on each link between ranks (the receives the transport
keeps posted): by hand for the classic schedules, and against an independent reference (explicit ancestor sets
in the schedule's dependency graph) for every schedule family."""

from __future__ import annotations

import pytest

from pipecore.algorithms import get_algorithm
from pipecore.schedule import (
    B, F, dualpipe_v, gpipe, interleaved_one_f_one_b, looped_bfs, one_f_one_b, zero_bubble_h1, zero_bubble_v,
)
from pipecore.schedule.links import messages_ahead


def _reference(schedule):
    """For each link, the largest (position of a send on the link) - (takes on the link among the sending
    action's ancestors): ancestors found by walking predecessors (the previous action of the rank, and the
    actions whose messages it takes) explicitly."""
    placement = schedule.placement
    last = schedule.num_stages - 1
    rows = schedule.rank_rows
    where = {}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            where[a] = (r, i)
    producer = {}
    for row in rows:
        for a in row:
            if a.kind in (F, B):
                for k in range(a.index, a.index + a.count):
                    producer[a.stage, a.kind, k] = a

    def preds(a):
        r, i = where[a]
        out = [rows[r][i - 1]] if i else []
        if a.kind is F and a.stage > 0:
            out.append(producer[a.stage - 1, F, a.index])
        if a.kind is B and a.stage < last:
            out += [producer[a.stage + 1, B, k] for k in range(a.index, a.index + a.count)]
        return out

    def ancestors(a):
        seen, todo = set(), [a]
        while todo:
            for p in preds(todo.pop()):
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def crossing(s, t):
        return placement[s] != placement[t]

    sends, takes = {}, {}  # link -> actions in order, one entry per message
    for row in rows:
        for a in row:
            for _ in range(a.count):
                if a.kind is F and a.stage < last and crossing(a.stage, a.stage + 1):
                    sends.setdefault((F, a.stage), []).append(a)
                if a.kind is F and a.stage > 0 and crossing(a.stage - 1, a.stage):
                    takes.setdefault((F, a.stage - 1), []).append(a)
                if a.kind is B and a.stage > 0 and crossing(a.stage - 1, a.stage):
                    sends.setdefault((B, a.stage - 1), []).append(a)
                if a.kind is B and a.stage < last and crossing(a.stage, a.stage + 1):
                    takes.setdefault((B, a.stage), []).append(a)
    result = {}
    for link, senders in sends.items():
        # Each link's sends and takes are in one rank's list order, message by message.
        senders.sort(key=lambda a: where[a][1])
        takers = sorted(takes[link], key=lambda a: where[a][1])
        lead = 1
        for position, a in enumerate(senders, start=1):
            before = ancestors(a)
            lead = max(lead, position - sum(1 for t in takers if t in before))
        result[link] = lead
    return result


def test_by_hand():
    # GPipe and looped BFS: a stage sends all m forwards (and the last stages all m backwards) with nothing from
    # the receiver in between.
    assert set(messages_ahead(gpipe(4, 8, 2)).values()) == {8}
    assert set(messages_ahead(looped_bfs(8, 8, 2, stages_per_rank=2)).values()) == {8}
    # 1F1B: stage b's warm-up and first pair send P - b forwards before its first backward, which waits for the
    # receiver; the last stage's backwards likewise run P - b ahead.
    assert messages_ahead(one_f_one_b(4, 8, 2)) == {(F, 0): 4, (B, 0): 4, (F, 1): 3, (B, 1): 3, (F, 2): 2, (B, 2): 2}
    # A boundary inside one rank (the V's turn: stages 3 and 4 on rank 3) has no link.
    links = messages_ahead(zero_bubble_v(8, 8, 2))
    assert (F, 3) not in links and (B, 3) not in links and len(links) == 12
    # One stage: no links.
    assert messages_ahead(gpipe(1, 4, 2)) == {}


@pytest.mark.parametrize("name,schedule", [
    ("gpipe", gpipe(3, 4, 2)),
    ("1f1b", one_f_one_b(4, 6, 2)),
    ("interleaved", interleaved_one_f_one_b(8, 8, 2, stages_per_rank=2)),
    ("looped-bfs", looped_bfs(6, 3, 2, stages_per_rank=2)),
    ("zb-h1", zero_bubble_h1(4, 8, 2)),
    ("zb-v", zero_bubble_v(8, 8, 2)),
    ("dualpipe-v", dualpipe_v(8, 8, 2)),
    ("pipedream", get_algorithm("pipedream", 4, 4).schedule(3)),
    ("2bw", get_algorithm("2bw", 4, 4).schedule(3)),
    ("nf1b", get_algorithm("v-timeprest", 4, 4).schedule(3)),
    ("timeprest", get_algorithm("timeprest", 4, 4).schedule(3)),
])
def test_equals_the_ancestor_count(name, schedule):
    assert messages_ahead(schedule) == _reference(schedule)
