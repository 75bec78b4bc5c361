"""The stage memory model and the recomputation cost model, against hand-computed numbers."""

from __future__ import annotations

import dataclasses

import pytest

from pipecore.planning import (GraphCosts, Sizing, StageModel, TiedParameter, ValueCost, fit_stage, stage_memory,
                               stage_time)
from pipecore.planning.memory import Choice

# Four nodes; the tests cut them into stage 0 = nodes [0, 3) and stage 1 = node [3, 4).
#   stage 0: parameters 1000 + 0 + 2000 = 3000, optimizer 6000, saved 100 + 200 + 300 = 600,
#            boundary per micro-batch: graph input 5 + crossing at 3 (35) = 40
#   stage 1: parameters 3000, optimizer 6000, saved 400, boundary per micro-batch: crossing at 3 (35) + 0
COSTS = GraphCosts(
    names=("a", "b", "c", "d"),
    forward_s=(2.0, 1.0, 1.0, 4.0),
    backward_s=(2.0, 4.0, 6.0, 8.0),
    output_bytes=(10, 20, 30, 40),
    saved_bytes=(100, 200, 300, 400),
    param_bytes=(1000, 0, 2000, 3000),
    optimizer_bytes=(2000, 0, 4000, 6000),
    crossing_bytes=(15, 25, 35),
    input_bytes=5,
)
STAGES = ((0, 3), (3, 4))


def sizing(name: str, **options) -> Sizing:
    """The hand-computed figures below are of a pipeline without undo copies (``recover=False``); the undo term
    has its own test."""
    return Sizing.of(name, 2, 2, recover=False, **options)


@pytest.mark.parametrize("name, versions, in_flight", [
    ("gpipe", (1, 1), (2, 2)),
    ("1f1b", (1, 1), (2, 1)),
    ("pipedream", (2, 1), (2, 1)),
    ("2bw", (2, 2), (2, 1)),
])
def test_sizing_reads_versions_and_in_flight_off_the_simulator(name, versions, in_flight):
    z = sizing(name)
    assert (z.algorithm, z.num_stages, z.n_microbatches) == (name, 2, 2)
    assert z.versions == versions and z.in_flight == in_flight
    assert z.derived == (False, False) and z.buffers == (0, 0) and not z.recompute_all


def test_sizing_of_pipemare_has_scratch_and_its_velocity_buffer():
    z = sizing("pipemare")
    assert z.versions == (1, 1) and z.in_flight == (2, 1)
    assert z.derived == (True, False) and z.buffers == (1, 1)
    assert sizing("pipemare", backward_rule="recompute").recompute_all


def test_sizing_of_zb_h1_splits_its_micro_batches_in_flight_into_pending_and_waiting_for_their_w():
    # 2 stages, 2 micro-batches: stage 0 peaks with both before their B, or one waiting for its W; the last
    # stage runs each B right after its F, so at most one is before its B, the other waiting (or both waiting).
    z = sizing("zb-h1")
    assert z.in_flight == (2, 2) and z.held == (((2, 0), (1, 1)), ((1, 1), (0, 2)))
    assert sizing("1f1b").held == (((2, 0),), ((1, 0),))  # no split backward: nothing waits for a W


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipe-v", "1f1b"])
def test_the_held_pairs_largest_sum_is_the_peak_in_flight_and_none_exceeds_another(name):
    z = Sizing.of(name, 4, 8, recover=False)
    for pairs, k in zip(z.held, z.in_flight):
        assert max(p + w for p, w in pairs) == k
        assert not any(q != p and q[0] >= p[0] and q[1] >= p[1] for p in pairs for q in pairs)


def test_a_micro_batch_waiting_for_its_w_keeps_what_the_nodes_up_to_the_last_weight_save_by_hand():
    # The last stage [2, 4) of COSTS with node d reading no parameter and a loss saving 50 per micro-batch. A
    # micro-batch before its B holds saved 300 + 400, the loss's 50 and its received input (crossing at 2: 25); one
    # waiting for its W keeps only what c (the last node reading a parameter) saves, 300, and the received input,
    # which without the graph's values is taken as saved by the stage's nodes: 325.
    costs = dataclasses.replace(COSTS, param_bytes=(1000, 0, 2000, 0), optimizer_bytes=(2000, 0, 4000, 0),
                                loss_saved_bytes=50)
    z = sizing("zb-h1")
    model = StageModel(costs, z)
    assert model.waiting(2, 4) == 300 + 25 and model.waiting(1, 2) == 0  # b reads no parameter: nothing waits
    m = model.memory(2, 4, 1)
    # (1 pending, 1 waiting) holds 775 + 325, more than (0, 2): 2 * 325.
    assert (m.activations, m.boundary) == (700 + 50 + 325, 25)
    assert m.total == 2000 + 2000 + 4000 + 1100 == 9100
    # With the graph's values (VALUES, below): of the two values received at 2, b's output (25, charged to b) is
    # saved by c and kept; a's output (15) no node of the stage saves, and the B frees it.
    values = dataclasses.replace(VALUES, param_bytes=costs.param_bytes, optimizer_bytes=costs.optimizer_bytes)
    assert StageModel(values, z).waiting(2, 4) == 300 + 25
    # Counted whole, as without a split backward (1f1b's one micro-batch in flight there, 2 here): 8000 + 2 * 775.
    whole = dataclasses.replace(z, held=(((2, 0),), ((2, 0),)))
    assert model.memory(2, 4, 1).total < StageModel(costs, whole).memory(2, 4, 1).total == 8000 + 2 * 775


@pytest.mark.parametrize("name, expected", [
    # weights x versions + gradients + optimizer + saved x in-flight + boundary x in-flight
    ("gpipe", (3000 + 3000 + 6000 + 2 * 600 + 2 * 40, 3000 + 3000 + 6000 + 2 * 400 + 2 * 35)),
    ("1f1b", (3000 + 3000 + 6000 + 2 * 600 + 2 * 40, 3000 + 3000 + 6000 + 400 + 35)),
    ("pipedream", (2 * 3000 + 3000 + 6000 + 2 * 600 + 2 * 40, 3000 + 3000 + 6000 + 400 + 35)),
    ("2bw", (2 * 3000 + 3000 + 6000 + 2 * 600 + 2 * 40, 2 * 3000 + 3000 + 6000 + 400 + 35)),
    # PipeMare: + scratch (stage 0 only) + velocity buffer
    ("pipemare", (3000 + 3000 + 3000 + 3000 + 6000 + 2 * 600 + 2 * 40, 3000 + 3000 + 3000 + 6000 + 400 + 35)),
])
def test_stage_memory_by_hand(name, expected):
    z = sizing(name)
    got = tuple(stage_memory(COSTS, a, b, s, z).total for s, (a, b) in enumerate(STAGES))
    assert got == expected
    assert got == {"gpipe": (13280, 12870), "1f1b": (13280, 12435), "pipedream": (16280, 12435),
                   "2bw": (16280, 15435), "pipemare": (19280, 15435)}[name]


@pytest.mark.parametrize("name, num_stages, ties, states, weights, gradients", [
    # gpipe: one mini-batch in flight, updated in place: one snapshot, with the weights it held.
    ("gpipe", 2, (), (1, 1), (1, 1), (0, 0)),
    # pipedream: two mini-batches incomplete somewhere when a step begins, both updated at every stage.
    ("pipedream", 2, (), (2, 2), (2, 2), (0, 0)),
    # 2bw: its ring keeps the previous version, so stage 0 never copies weights; the last stage does.
    ("2bw", 2, (), (1, 2), (0, 2), (0, 0)),
    # A tied weight between the first and last stages, its gradients applied late (pipedream on 4 stages): the
    # stages holding it snapshot one update group early, with their gradient buffer (as a GPT's do).
    ("pipedream", 4, ((0, 3),), (2, 2, 2, 2), (2, 2, 2, 2), (2, 0, 0, 2)),
])
def test_sizing_counts_the_copies_that_undo_a_failed_step(name, num_stages, ties, states, weights, gradients):
    z = Sizing.of(name, num_stages, 2 if num_stages == 2 else 4, ties=ties)
    assert (z.undo_states, z.undo_weights, z.undo_gradients) == (states, weights, gradients)
    assert Sizing.of(name, num_stages, 2, recover=False).undo_states == (0,) * num_stages


def test_the_undo_term_is_state_weights_and_gradient_copies():
    z = dataclasses.replace(sizing("pipemare"), undo_states=(2, 1), undo_weights=(1, 0), undo_gradients=(1, 1))
    first, last = (stage_memory(COSTS, a, b, s, z) for s, (a, b) in enumerate(STAGES))
    # Per state copy: the optimizer state and the declared buffer (weight-sized); per weight or gradient copy, W.
    assert first.undo == 2 * (6000 + 3000) + 3000 + 3000
    assert last.undo == 6000 + 3000 + 3000
    assert first.total == 19280 + first.undo and last.total == 15435 + last.undo


def test_stage_memory_terms_by_hand():
    m = stage_memory(COSTS, 0, 3, 0, sizing("pipemare"))
    assert (m.weights, m.gradients, m.scratch, m.buffers, m.optimizer) == (3000, 3000, 3000, 3000, 6000)
    assert (m.activations, m.recomputation, m.boundary) == (1200, 0, 80)
    last = stage_memory(COSTS, 3, 4, 1, sizing("pipedream"))
    assert (last.weights, last.scratch, last.buffers, last.activations, last.boundary) == (3000, 0, 0, 400, 35)


@pytest.mark.parametrize("segments, activations, recomputation", [
    # [1, 3) keeps its input (crossing at 1: 15) instead of 200 + 300: kept 600 - 500 + 15 = 115 per micro-batch
    (((1, 3),), 2 * 115, 500),
    # a segment at the stage's start keeps nothing more than the stage input: kept 600 - 300 = 300
    (((0, 2),), 2 * 300, 300),
    # two segments keep their inputs (0 and crossing at 2: 25); the larger one sets the transient
    (((0, 1), (2, 3)), 2 * (600 - 100 - 300 + 25), 300),
])
@pytest.mark.parametrize("name", ["gpipe", "pipedream"])
def test_stage_memory_with_recomputed_segments_by_hand(name, segments, activations, recomputation):
    z = sizing(name)
    base = stage_memory(COSTS, 0, 3, 0, z)
    m = stage_memory(COSTS, 0, 3, 0, z, segments)
    assert (m.activations, m.recomputation) == (activations, recomputation)
    assert m.total == base.total - base.activations + activations + recomputation
    assert m.weights == base.weights and m.boundary == base.boundary == 80


# The same graph with its values (GraphCosts.values): the input x is saved by a; a's output by b and read
# again by c (a skip); b saves its own output, which c saves too; c's output is sent to d, which saves it.
# Saved bytes per node: values charged to their first saver, the rest no value (BatchNorm's statistics, say):
#   a: x 5 + 95, b: a's output 15 + b's output 25 + 160, c: 300, d: c's output 35 + 365.
VALUES = dataclasses.replace(
    COSTS,
    crossing_bytes=(15, 15 + 25, 35),
    values=(
        ValueCost(-1, 5, savers=(0,), users=(0,)),
        ValueCost(0, 15, savers=(1,), users=(1, 2)),
        ValueCost(1, 25, savers=(1, 2), users=(2,)),
        ValueCost(2, 35, savers=(3,), users=(3,)),
        ValueCost(3, 40, savers=(), users=(4,)),
    ),
)


@pytest.mark.parametrize("segments, kept, recomputation", [
    # b alone: its input (a's output) is the segment's input, its output c saves: only its other 160 go.
    # Recomputing it holds those and its output again: 160 + 25.
    (((1, 2),), 600 - 160, 160 + 25),
    # b and c: b's output goes too; the input stays (the checkpoint keeps it, saved by b before).
    (((1, 3),), 600 - 25 - 460, 460 + 25),
    # a and c: x is the stage's input and a's and b's outputs are saved by b, which is not recomputed;
    # a frees its other 95, c its 300; c's recomputation makes nothing it saves.
    (((0, 1), (2, 3)), 600 - 95 - 300, 300),
])
def test_stage_memory_with_recomputed_segments_from_the_values(segments, kept, recomputation):
    z = sizing("gpipe")
    base = stage_memory(VALUES, 0, 3, 0, z)
    m = stage_memory(VALUES, 0, 3, 0, z, segments)
    assert (m.activations, m.recomputation) == (2 * kept, recomputation)
    assert m.total == base.total - base.activations + 2 * kept + recomputation


def test_a_segment_input_nothing_saved_is_kept():
    # As VALUES, but b saves nothing of a's output: recomputing b keeps that input (15) where nothing did.
    values = list(VALUES.values)
    values[1] = ValueCost(0, 15, savers=(), users=(1, 2))
    costs = dataclasses.replace(VALUES, saved_bytes=(100, 185, 300, 400), values=tuple(values))
    m = stage_memory(costs, 0, 3, 0, sizing("gpipe"), ((1, 2),))
    assert m.activations == 2 * (585 - 160 + 15)


def test_tied_parameters_and_the_loss_count_at_the_last_stage():
    costs = dataclasses.replace(COSTS, tied=(TiedParameter(1000, 2000, (0, 3)),), loss_saved_bytes=50, loss_s=3.0)
    z = sizing("pipedream")
    last = stage_memory(costs, 3, 4, 1, z)
    assert (last.weights, last.gradients, last.optimizer) == (3000 + 1000, 3000 + 1000, 6000 + 2000)
    assert last.activations == 400 + 50  # one micro-batch in flight keeps what the loss saves
    assert stage_time(costs, 3, 4, z) == pytest.approx(4 + 8 + 3)
    assert stage_memory(costs, 0, 3, 0, z) == stage_memory(COSTS, 0, 3, 0, z)  # the first reader's stage
    # Under backward_rule="recompute" the last stage recomputes the loss with its forward.
    recompute = stage_memory(costs, 3, 4, 1, sizing("pipemare", backward_rule="recompute"))
    assert (recompute.activations, recompute.recomputation) == (0, 400 + 50)


def test_stage_time_adds_the_recomputed_forward():
    z = sizing("pipedream")
    assert stage_time(COSTS, 0, 3, z) == pytest.approx(2 + 1 + 1 + 2 + 4 + 6)
    assert stage_time(COSTS, 0, 3, z, ((1, 3),)) == pytest.approx(16 + 1 + 1)
    assert stage_time(COSTS, 0, 4, z, ((0, 1), (3, 4))) == pytest.approx(28 + 2 + 4)


def test_recompute_backward_rule_keeps_only_stage_inputs():
    z = sizing("pipemare", backward_rule="recompute")
    m = stage_memory(COSTS, 0, 3, 0, z)
    # no saved bytes per micro-batch; the whole stage's saved bytes once, during its recomputation
    assert (m.activations, m.recomputation) == (0, 600)
    assert m.total == 4 * 3000 + 6000 + 600 + 80
    assert stage_time(COSTS, 0, 3, z) == pytest.approx(16 + 4)
    with pytest.raises(ValueError, match="recomputes every forward"):
        stage_memory(COSTS, 0, 3, 0, z, ((1, 3),))


def test_memory_path_by_hand():
    """Stage 0 under pipedream (2 in flight). Bytes freed per second of extra forward, first step:
    [2,3): 2*(300-25) - 300 = 250 in 1 s; [1,3): 2*(500-15) - 500 = 470 in 2 s (235/s); [1,2): 170/s; ...
    then, with a transient of 300 already paid: [1,2): 2*(200-15) = 370/s; [0,2) 200/s; then [0,1)."""
    model = StageModel(COSTS, sizing("pipedream"))
    path = model.memory_path(0, 3, 0)
    assert [c.recomputed for c in path] == [(), ((2, 3),), ((1, 2), (2, 3)), ((0, 1), (1, 2), (2, 3))]
    assert [c.memory.total for c in path] == [16280, 16030, 15660, 15460]
    assert all(c.offloaded == () for c in path)  # no host bandwidth: no offload
    assert [c.time for c in path] == pytest.approx([16, 17, 18, 20])
    assert model.smallest_memory(0, 3, 0) == 15460

    fit = fit_stage(COSTS, 0, 3, 0, sizing("pipedream"), memory_limit=16000)
    assert fit.fits and fit.recomputed == ((1, 2), (2, 3)) and fit.offloaded == () and fit.memory.total == 15660
    assert fit.time == pytest.approx(16 + 1 + 1)
    assert model.fit(0, 3, 0, 16030).recomputed == ((2, 3),)
    assert model.fit(0, 3, 0, 16280).recomputed == ()           # fits as it is: nothing recomputed
    assert model.fit(0, 3, 0, None).recomputed == ()
    for limit in (15459, 15000):                                 # below what every step reaches
        fit = model.fit(0, 3, 0, limit)
        assert not fit.fits and fit.recomputed == () and fit.time == pytest.approx(16)


def test_recomputation_never_helps_with_one_micro_batch_in_flight():
    # The last stage under 1F1B holds one micro-batch: recomputing frees its saved bytes but needs them again.
    model = StageModel(COSTS, sizing("1f1b"))
    assert model.memory_path(3, 4, 1) == [Choice((), (), model.memory(3, 4, 1), model.time(3, 4))]
    assert not model.fit(3, 4, 1, 12000).fits


def test_activation_terms_scale_with_the_micro_batch():
    z = sizing("gpipe")
    one, four = stage_memory(COSTS, 0, 3, 0, z), stage_memory(COSTS.at_microbatch_size(4), 0, 3, 0, z)
    assert (four.activations, four.boundary) == (4 * one.activations, 4 * one.boundary)
    assert (four.weights, four.optimizer) == (one.weights, one.optimizer)
    assert COSTS.at_microbatch_size(4).input_bytes == 20


@pytest.mark.parametrize("args, match", [
    ((2, 2, 0, ()), r"0 <= start < end <= 4"),
    ((0, 5, 0, ()), r"0 <= start < end <= 4"),
    ((0, 3, 2, ()), r"stage must lie in 0..1"),
    ((0, 3, 0, ((1, 4),)), r"inside the stage's nodes \[0, 3\)"),
    ((0, 3, 0, ((0, 2), (1, 3))), r"non-overlapping"),
    ((0, 3, 0, ((2, 2),)), r"non-empty"),
])
def test_bad_stage_arguments(args, match):
    start, end, stage, segments = args
    with pytest.raises(ValueError, match=match):
        stage_memory(COSTS, start, end, stage, sizing("gpipe"), segments)


def test_bad_sizing():
    with pytest.raises(ValueError, match="versions has 1 entries for 2 stages"):
        Sizing("x", 2, 2, (1,), (False, False), (0, 0), (1, 1))
    with pytest.raises(ValueError, match="needs num_stages and n_microbatches"):
        Sizing.of("gpipe")
    with pytest.raises(ValueError, match="largest sum is in_flight"):
        Sizing("x", 2, 2, (1, 1), (False, False), (0, 0), (2, 1), held=(((2, 0),), ((1, 1),)))
