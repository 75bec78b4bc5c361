"""How far ahead of its receiver a sender can get on each link between two ranks.

A link is a stage boundary whose two stages run on different ranks, in one direction: ``(F, b)`` carries
the activations from stage ``b`` to ``b + 1``, ``(B, b)`` the input gradients from ``b + 1`` to ``b``. The
transport keeps receives posted ahead on each link (gloo moves a message only once its receive is posted);
this module says how many can be useful: the most messages the sender can have sent on the link before the
receiver has started taking them, over every execution the schedule allows. A breadth-first schedule sends
a stage's ``m`` activations with nothing from the receiver in between (``m``); 1F1B's first stage sends its
warm-up forwards (``P``), and later each forward waits, through the backwards, for the receiver.
"""

from __future__ import annotations

from .ir import Action, B, F, Kind
from .progress import runnable
from .schedule import Schedule

Link = tuple[Kind, int]


def _links_of(action: Action, placement: tuple[int, ...]) -> tuple[Link | None, Link | None]:
    """The link ``action`` takes its messages from and the link it sends on (None: none, or inside a rank)."""
    s, last = action.stage, len(placement) - 1
    if action.kind is F:
        takes = (F, s - 1) if s > 0 and placement[s - 1] != placement[s] else None
        sends = (F, s) if s < last and placement[s + 1] != placement[s] else None
        return takes, sends
    if action.kind is B:
        takes = (B, s) if s < last and placement[s + 1] != placement[s] else None
        sends = (B, s - 1) if s > 0 and placement[s - 1] != placement[s] else None
        return takes, sends
    return None, None


def _execution_order(schedule: Schedule) -> list[Action]:
    """The actions in an order the schedule can run them in (the validator's dependency walk)."""
    order: list[Action] = []
    cursors = runnable(schedule, [0] * schedule.num_stages, ran=order)
    if any(c < len(row) for c, row in zip(cursors, schedule.stages)):
        raise ValueError("the schedule cannot run to completion; validate it first")
    return order


def messages_ahead(schedule: Schedule) -> dict[Link, int]:
    """For every link between two ranks: the most messages its sender can have sent that its receiver has
    not started to take, in any execution of ``schedule`` (at least 1).

    Each action carries, per link, how many of the link's messages the receiver must have taken before it
    can run (through the rank's order and the messages it waits for); a send's lead is its position on the
    link minus that count. Dependencies outside the action lists (tied weights, the global gradient norm)
    only order more, so the result is an upper bound where they apply.
    """
    placement = schedule.placement
    links = sorted({link for row in schedule.rank_rows for a in row for link in _links_of(a, placement) if link},
                   key=lambda link: (link[1], link[0].value))
    if not links:
        return {}
    slot = {link: i for i, link in enumerate(links)}
    zero = [0] * len(links)
    rank_known = [zero] * schedule.num_ranks  # per rank: takes known to precede its next action, per link
    sent_known: dict[tuple[int, Kind, int], list[int]] = {}  # per message: what its sender's action knew
    sends, takes = [0] * len(links), [0] * len(links)
    ahead = [1] * len(links)
    for a in _execution_order(schedule):
        r = placement[a.stage]
        known = rank_known[r]
        take, send = _links_of(a, placement)
        micro = range(a.index, a.index + a.count)
        if take is not None:
            source = (a.stage - 1, F) if a.kind is F else (a.stage + 1, B)
            for k in micro:
                known = [max(x, y) for x, y in zip(known, sent_known.pop((*source, k)))]
            i = slot[take]
            takes[i] += a.count
            known = known.copy()
            known[i] = max(known[i], takes[i])
        if send is not None:
            i = slot[send]
            for k in micro:
                sends[i] += 1
                ahead[i] = max(ahead[i], sends[i] - known[i])
                sent_known[a.stage, a.kind, k] = known
        rank_known[r] = known
    return dict(zip(links, ahead))
