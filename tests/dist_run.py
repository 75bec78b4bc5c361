"""A multi-process pipeline run for the tests: ``python dist_run.py MODE OUT_DIR [ARGS]``.

Launched once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun does); the
pipeline joins the process group from that environment. The same functions build the one-process
reference in the test, so both runs see identical models and data.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
from torch import nn

import pipecore
from pipecore import checkpoint

MICROBATCHES = 4
STEPS = 4


def make_model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(2 * num_stages):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    layers.append(nn.Linear(6, 3))
    return nn.Sequential(*layers).double()


def batches(steps: int, seed: int = 1):
    """Batches of 4, 8 and 12 samples in turn: activation shapes change between steps (shape exchange)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [MICROBATCHES * (1 + i % 3) for i in range(steps)]
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in sizes]


def dp_batches(steps: int, seed: int = 3, sizes: tuple[int, ...] = (16, 24, 32)):
    """Global mini-batches for two replicas (of 16, 24 and 32 samples in turn)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in (sizes[i % len(sizes)] for i in range(steps))]


def as_one_process(batch: torch.Tensor, replicas: int, microbatches: int) -> torch.Tensor:
    """The global mini-batch reordered so that one process's micro-batch k holds every replica's micro-batch k
    (replica i reads part i of the mini-batch and splits it into micro-batches; an algorithm that updates per
    micro-batch then sees the same groups in one process)."""
    parts = [torch.tensor_split(shard, microbatches) for shard in torch.tensor_split(batch, replicas)]
    return torch.cat([parts[i][k] for k in range(microbatches) for i in range(replicas)])


def dp_gpt_batches(steps: int, seed: int = 3):
    """Global token batches of 16 sequences for two replicas."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (16, 8), generator=g), torch.randint(0, 11, (16, 8), generator=g))
            for _ in range(steps)]


def uneven_batches():
    """Batches that do not divide into the micro-batches: 30 samples (8, 8, 7, 7), 5 (2, 1, 1, 1), 13, 4."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in (30, 5, 13, 4)]


def make_gpt():
    from pipecore.models import GPT

    torch.manual_seed(0)
    return GPT(11, 8, n_layer=3, n_head=2, n_embd=8).double()


def gpt_batches(steps: int, seed: int = 1):
    """Token batches whose sequence length changes between steps (8, 6, 7, ...)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        t = 8 - i % 3
        out.append((torch.randint(0, 11, (8, t), generator=g), torch.randint(0, 11, (8, t), generator=g)))
    return out


def lm_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_gpt_pipeline(num_stages: int, algorithm: str, **kwargs) -> pipecore.Pipeline:
    return pipecore.Pipeline(make_gpt(), num_stages, algorithm, MICROBATCHES,
                             optimizer=pipecore.SGD(lr=0.1, momentum=0.9), loss_fn=lm_loss, **kwargs)


def poisoned_batches():
    """``batches(STEPS)`` with a NaN in the first sample of the second batch: one micro-batch's loss is NaN."""
    data = batches(STEPS)
    data[1][0][0, 0] = float("nan")
    return data


#: What a ``+variant`` after an algorithm's name adds to its options.
VARIANTS = {"slack": {"slack": 1}, "adaptive": {"adaptive": True}}


def make_pipeline(num_stages: int, algorithm: str, **kwargs) -> pipecore.Pipeline:
    """``algorithm`` may end in variants: ``+slack`` (the option ``slack=1``), ``+adaptive`` (``adaptive=True``),
    ``+nadam`` (torch's NAdam with decoupled weight decay instead of SGD with momentum)."""
    m = MICROBATCHES
    algorithm, *variants = algorithm.split("+")
    optimizer = pipecore.SGD(lr=0.1, momentum=0.9)
    for variant in variants:
        if variant == "nadam":
            optimizer = functools.partial(torch.optim.NAdam, lr=0.01, betas=(0.99, 0.999), momentum_decay=0.004,
                                          decoupled_weight_decay=True, weight_decay=0.01)
        elif variant in VARIANTS:
            kwargs = {**kwargs, **VARIANTS[variant]}
        else:
            raise SystemExit(f"unknown variant +{variant}; one of {sorted(VARIANTS) + ['nadam']}")
    return pipecore.Pipeline(make_model(num_stages), num_stages, algorithm, m,
                             optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), **kwargs)


class TiedMLP(nn.Module):
    """An MLP whose output layer reuses the input layer's weight (as a language model's head does): the weight
    is tied across the first and the last stage. For the schedules with several stages per rank."""

    WIDTH = 6

    def __init__(self, depth: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(self.WIDTH, self.WIDTH)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(self.WIDTH, self.WIDTH), nn.Tanh()) for _ in range(depth)])
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.blocks(torch.tanh(self.embed(x))), self.embed.weight)


MODERN_MICROBATCHES = 8  # a multiple of the ranks of every configuration the tests run


def tied_batches(steps: int, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, TiedMLP.WIDTH, generator=g, dtype=torch.float64),
             torch.randint(0, TiedMLP.WIDTH, (batch,), generator=g)) for _ in range(steps)]


def make_modern_pipeline(algorithm: str, chunks: int, stages_per_rank: int, **kwargs) -> pipecore.Pipeline:
    """``chunks`` stages of a TiedMLP (cut among its blocks), ``stages_per_rank`` on each rank."""
    return pipecore.Pipeline(TiedMLP(), chunks, algorithm, MODERN_MICROBATCHES, loss_fn=nn.CrossEntropyLoss(),
                             partition=[f"blocks.{i}" for i in range(chunks - 1)],
                             optimizer=pipecore.SGD(lr=0.1, momentum=0.9), stages_per_rank=stages_per_rank, **kwargs)


CLIP = 0.05  # the clip_grad_norm of the "clip" mode: small enough to clip every step


def cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule of the ``lr`` mode: a torch scheduler over a few updates."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)


def lr_runs(world: int, algorithm: str, first: bool, last: bool, **kwargs):
    """The ``lr`` mode's two runs: a torch scheduler stepped at each stage's updates; set_lr() between steps.
    Returns the losses of both and the two pipelines."""
    scheduled = make_pipeline(world, algorithm, lr_scheduler=cosine, **kwargs)
    losses = train(scheduled, batches(STEPS), first, last)
    fixed = make_pipeline(world, algorithm, **kwargs)
    data = batches(STEPS)
    losses += train(fixed, data[:2], first, last)
    fixed.set_lr(0.03)
    losses += train(fixed, data[2:], first, last)
    return losses, scheduled, fixed


RECOVER_ARM = 2
RECOVER_CLIP_CASES = [(algorithm, failing, kind) for algorithm in ("gpipe", "1f1b") for failing in (0, 1)
                      for kind in "FBU"]
RECOVER_CASES = [(algorithm, failing, kind) for algorithm in ("gpipe", "1f1b", "2bw", "pipedream", "i-timeprest")
                 for failing in (0, 1) for kind in "FBU"]


RECOVER_GPT_CASES = [(algorithm, failing, kind) for algorithm in ("1f1b", "pipedream", "2bw")
                     for failing in (0, 1) for kind in "FBU"]


def fail_once(pipe: pipecore.Pipeline, kind: str) -> None:
    """Make this rank's first action of ``kind`` for the newest mini-batch raise, once, after its compute."""
    stage = next(iter(pipe.stages.values()))
    name = {"F": "compute_forward", "B": "compute_backward", "U": "compute_update"}[kind]
    original = getattr(stage, name)
    every, m = pipe.algorithm.update_every, pipe.n_microbatches

    def hook(action, *args):
        first = (action.index - 1) * every if kind == "U" else action.index
        out = original(action, *args)
        if first >= (pipe._steps.fed - 1) * m and getattr(stage, name) is hook:
            setattr(stage, name, original)
            raise RuntimeError(f"injected failure after {action}")
        return out

    setattr(stage, name, hook)


def train_through_failure(pipe: pipecore.Pipeline, data, kind: str | None, first: bool, last: bool) -> dict:
    """Train on ``data[pipe.minibatches]`` until every batch is kept, then flush; with ``kind``, this rank's first
    action of that kind for the mini-batch given after RECOVER_ARM steps raises once (``fail_once``). Returns
    the losses, the state and the first mini-batch undone (a flush took its place)."""
    losses: list = [None] * len(data)
    failed_at = None
    while True:
        while pipe.minibatches < len(data):
            i = pipe.minibatches
            if i == RECOVER_ARM and kind is not None:
                fail_once(pipe, kind)
                kind = None
            try:
                losses[i] = pipe.step(data[i][0] if first else None, data[i][1] if last else None)
            except (RuntimeError, pipecore.PeerError) as exc:
                assert "training can continue" in exc.__notes__[-1], exc.__notes__
                failed_at = pipe.minibatches
        try:
            pipe.flush()  # the failure may strike here too (the last updates of an asynchronous schedule)
            break
        except (RuntimeError, pipecore.PeerError) as exc:
            assert "training can continue" in exc.__notes__[-1], exc.__notes__
            failed_at = pipe.minibatches
    return {"losses": losses, "state": pipe.state_dict(), "failed_at": failed_at}


def tie_gradient(rank: int, group: int, generation: int) -> torch.Tensor:
    """The ``ties-undo`` mode's gradient of tie ``w`` that ``rank`` posts for ``group`` (``generation`` 1: posted
    again after the failure, other values)."""
    g = torch.Generator().manual_seed(100 * generation + 10 * group + rank)
    return torch.randn(3, 4, generator=g, dtype=torch.float64)


def ties_undo(rank: int, out: str) -> None:
    """The ``ties-undo`` mode: the exchange of 2 ranks that both own tie ``w``, taken back after a failure.

    Rank 0 posts groups 0..3 and reduces 0..2; rank 1 posts 0..2, reduces 0 and stops at an error: it sends a
    failure notice, which rank 0's reduce of group 3 raises with. Groups 2 and later are undone: both withdraw
    them, rank 0's updates that reduced 1 and 2 are undone (unreduce), and after resync both post 2 and 3
    again, with other values, and reduce 1..3. Saves the sums and the errors raised."""
    import datetime

    import torch.distributed as dist

    from pipecore.runtime.ties import DistributedTiedGradients

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ties = DistributedTiedGradients({"w": (0, 1)}, rank, timeout=20, shapes={"w": ((3, 4), torch.float64)})
    record: dict = {"sums": {}, "errors": {}}
    ties.new_epoch(forget_before=None)
    for group in range(4 if rank == 0 else 3):
        ties.post(rank, group, {"w": tie_gradient(rank, group, 0)})
    for group in range(3 if rank == 0 else 1):
        record["sums"][group, 0] = ties.reduce(rank, group)["w"]
    if rank == 1:
        ties.notify_failure("RuntimeError at stage 1: injected")
    else:
        try:
            ties.reduce(rank, 3)
        except pipecore.PeerError as exc:
            record["errors"]["reduce"] = (str(exc), exc.cause)
    counts: list = [None, None]
    dist.all_gather_object(counts, ties.sent_counts())
    if rank == 0:
        ties.unreduce(rank, range(1, 3))
    ties.withdraw(rank, 2)
    ties.resync(counts, 2)
    for group in (2, 3):
        ties.post(rank, group, {"w": tie_gradient(rank, group, 1)})
    for group in (1, 2, 3):
        record["sums"][group, 1] = ties.reduce(rank, group)["w"]
    ties.new_epoch(forget_before=None)  # forgets every group reduced so far
    try:
        ties.unreduce(rank, range(3, 4))
    except RuntimeError as exc:
        record["errors"]["forgotten"] = str(exc)
    ties.close()
    torch.save(record, os.path.join(out, f"ties-undo-{rank}.pt"))
    dist.destroy_process_group()


def ties_last_message(rank: int, out: str) -> None:
    """The ``ties-last`` mode: 2 owners of tie ``w`` exchange group 0. Rank 0 reduces it, closes and leaves;
    rank 1 reduces it only once rank 0 has closed its connection. Taking a message posts the receive of the
    next one ahead, which then cannot be posted: no error until a next message is waited for. Rank 1 then
    posts group 1 and reduces it, which must raise a PeerError (there is no rank 0 to answer). Saves the sums
    and that error."""
    import datetime

    import torch.distributed as dist

    from pipecore.runtime.ties import DistributedTiedGradients

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ties = DistributedTiedGradients({"w": (0, 1)}, rank, timeout=20, shapes={"w": ((3, 4), torch.float64)})
    ties.post(rank, 0, {"w": tie_gradient(rank, 0, 0)})
    record: dict = {}
    if rank == 1:
        time.sleep(3)  # rank 0 reduces, closes and leaves meanwhile
    record["sum"] = ties.reduce(rank, 0)["w"]
    if rank == 1:
        try:
            ties.post(rank, 1, {"w": tie_gradient(rank, 1, 0)})
            ties.reduce(rank, 1)
        except pipecore.PeerError as exc:
            record["error"] = str(exc)
    ties.close(deliver=rank == 0)
    torch.save(record, os.path.join(out, f"ties-last-{rank}.pt"))
    dist.destroy_process_group()


def train(pipe: pipecore.Pipeline, data, first: bool, last: bool) -> list[float]:
    losses = [pipe.step(x if first else None, y if last else None) for x, y in data]
    pipe.flush()
    return losses


#: The cases of the ``predict`` mode: an MLP per algorithm, and a GPT (token inputs, a tied head).
PREDICT_ALGORITHMS = ["gpipe", "pipedream", "2bw"]
PREDICT_CASES = [*PREDICT_ALGORITHMS, "gpt"]


def predict_case(world: int, case: str, **kwargs):
    """``(pipeline, training batches, inputs to predict after step i)`` of a ``predict`` case."""
    if case == "gpt":
        def tokens(i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(100 + i)
            return torch.randint(0, 11, (3 + i, 8 - i % 3), generator=g)

        return make_gpt_pipeline(world, "pipedream", **kwargs), gpt_batches(STEPS), tokens
    return make_pipeline(world, case, **kwargs), batches(STEPS), predict_input


def predict_input(i: int) -> torch.Tensor:
    """What the ``predict`` mode predicts after step ``i``: 5, 6, 7, ... samples (not divisible by the
    micro-batches, mostly)."""
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(5 + i, 6, generator=g, dtype=torch.float64)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first, last = rank == 0, rank == world - 1
    if mode == "compare":
        split = len(sys.argv) > 4 and sys.argv[4] == "split"
        for algorithm in sys.argv[3].split(","):
            pipe = make_pipeline(world, algorithm, timeout=60, split_backward=split)
            losses = train(pipe, batches(STEPS), first, last)
            torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"{algorithm}-{rank}.pt"))
    elif mode == "modern":
        # Several stages per rank (interleaved, looped, V placements), split backwards, a tied weight: every
        # configuration "algorithm:chunks:stages_per_rank[:clip]".
        for config in sys.argv[3].split(","):
            algorithm, chunks, spr, *extra = config.split(":")
            kwargs = {"clip_grad_norm": CLIP} if extra == ["clip"] else {}
            pipe = make_modern_pipeline(algorithm, int(chunks), int(spr), timeout=60, **kwargs)
            losses = train(pipe, tied_batches(3), 0 in pipe.stages, int(chunks) - 1 in pipe.stages)
            prediction = pipe.predict(tied_batches(1, seed=7)[0][0] if 0 in pipe.stages else None, broadcast=True)
            torch.save({"losses": losses, "state": pipe.state_dict(), "prediction": prediction,
                        "stages": sorted(pipe.stages)}, os.path.join(out, f"{config.replace(':', '-')}-{rank}.pt"))
    elif mode == "dp":
        # Data x pipeline parallelism: WORLD = replicas x stages; every rank gets the global mini-batches.
        stages = int(sys.argv[4])
        for algorithm in sys.argv[3].split(","):
            if algorithm == "gpt":
                pipe = make_gpt_pipeline(stages, "1f1b", timeout=60, data_parallel=world // stages)
                data = dp_gpt_batches(STEPS)
            else:
                pipe = make_pipeline(stages, algorithm, timeout=60, data_parallel=world // stages)
                data = dp_batches(STEPS)
            losses = train(pipe, data, 0 in pipe.stages, stages - 1 in pipe.stages)
            torch.save({"losses": losses, "state": pipe.state_dict(), "replica": pipe.replica},
                       os.path.join(out, f"dp-{algorithm}-{rank}.pt"))
    elif mode == "dp-features":
        # Data x pipeline parallelism, 2 x 2: global-norm clipping; each replica's own shard (local=True); a
        # DeviceMesh; a checkpoint that replica 0 writes.
        record: dict = {}
        data = dp_batches(STEPS)
        first_stage, last_stage = rank % 2 == 0, rank % 2 == 1
        pipe = make_pipeline(2, "1f1b", timeout=60, data_parallel=2, clip_grad_norm=CLIP)
        record["clip"] = (train(pipe, data, first_stage, last_stage), pipe.state_dict())
        pipe.close()
        pipe = make_pipeline(2, "1f1b", timeout=60, data_parallel=2)
        losses = []
        for x, y in data:
            x, y = torch.tensor_split(x, 2)[pipe.replica], torch.tensor_split(y, 2)[pipe.replica]
            losses.append(pipe.step(x if first_stage else None, y if last_stage else None, local=True))
        pipe.flush()
        record["local"] = (losses, pipe.state_dict())
        checkpoint.save(pipe, os.path.join(out, "ckpt"))
        record["saved"] = pipe.state_dict()
        pipe.close()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        pipe = make_pipeline(2, "1f1b", timeout=60, mesh=mesh)
        record["mesh"] = (train(pipe, data, first_stage, last_stage), pipe.state_dict(), pipe.replica, pipe.rank)
        torch.save(record, os.path.join(out, f"dp-features-{rank}.pt"))
    elif mode == "dp-die":
        # A replica's rank dies mid-run: the other ranks name what failed within the timeout.
        timeout = float(sys.argv[3])
        pipe = make_pipeline(2, "1f1b", timeout=timeout, data_parallel=2)
        data = dp_batches(STEPS)
        first_stage, last_stage = rank % 2 == 0, rank % 2 == 1
        if rank == 3:
            pipe.step(None, data[0][1])
            os._exit(0)
        start = time.monotonic()
        try:
            for x, y in data:
                pipe.step(x if first_stage else None, y if last_stage else None)
            pipe.flush()
        except pipecore.PeerError as exc:
            with open(os.path.join(out, f"error-{rank}.txt"), "w") as f:
                f.write(f"{time.monotonic() - start:.3f}\n{exc}")
    elif mode == "uneven":
        for algorithm in sys.argv[3].split(","):
            pipe = make_pipeline(world, algorithm, timeout=60)
            losses = train(pipe, uneven_batches(), first, last)
            torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"uneven-{algorithm}-{rank}.pt"))
    elif mode == "clip":
        # Gradient clipping: the global norm gathered over the ranks (gpipe, 1f1b; a tied GPT head), per-stage
        # norms (pipedream).
        for algorithm in sys.argv[3].split(","):
            pipe = make_pipeline(world, algorithm, timeout=60, clip_grad_norm=CLIP)
            losses = train(pipe, batches(STEPS), first, last)
            torch.save({"losses": losses, "state": pipe.state_dict(), "stats": pipe.stats()},
                       os.path.join(out, f"clip-{algorithm}-{rank}.pt"))
        pipe = make_gpt_pipeline(world, "1f1b", timeout=60, clip_grad_norm=CLIP)
        losses = train(pipe, gpt_batches(STEPS), first, last)
        torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"clip-gpt-{rank}.pt"))
    elif mode == "lr":
        for algorithm in sys.argv[3].split(","):
            losses, pipe, fixed = lr_runs(world, algorithm, first, last, timeout=60)
            torch.save({"losses": losses, "state": pipe.state_dict(), "fixed": fixed.state_dict()},
                       os.path.join(out, f"lr-{algorithm}-{rank}.pt"))
    elif mode == "gpt":
        for algorithm in sys.argv[3].split(","):
            pipe = make_gpt_pipeline(world, algorithm, timeout=60)
            losses = train(pipe, gpt_batches(STEPS), first, last)
            torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"{algorithm}-{rank}.pt"))
    elif mode == "checkpoint":
        # ranks train, save per-stage files; the test resumes them in one process
        algorithm = sys.argv[3]
        pipe = make_pipeline(world, algorithm, timeout=60)
        train(pipe, batches(STEPS), first, last)
        checkpoint.save(pipe, os.path.join(out, "ckpt"))
        # and resume a checkpoint the one-process pipeline wrote, training further
        pipe = make_pipeline(world, algorithm, timeout=60)
        checkpoint.load(pipe, os.path.join(out, "local-ckpt"))
        losses = train(pipe, batches(2, seed=5), first, last)
        torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"resumed-{rank}.pt"))
    elif mode == "full":
        # Every rank gets the whole model (full_state_dict) and every stage's statistics; a fresh pipeline on
        # each rank then resumes from that whole-model state and trains on.
        algorithm = sys.argv[3]
        pipe = make_pipeline(world, algorithm, timeout=60)
        train(pipe, batches(STEPS), first, last)
        full = pipe.full_state_dict()
        stages = [st["stage"] for st in pipe.stats(all_stages=True)]
        resumed = make_pipeline(world, algorithm, timeout=60)
        resumed.load_state_dict(full)
        losses = train(resumed, batches(2, seed=5), first, last)
        devices = {name: p.device.type for name, p in pipe.model.named_parameters()}
        torch.save({"full": full, "stages": stages, "losses": losses, "state": resumed.state_dict(),
                    "devices": devices}, os.path.join(out, f"full-{rank}.pt"))
    elif mode == "nonfinite":
        # A NaN loss in one micro-batch. With on_nonfinite="skip", every rank skips that update group: the
        # last rank sees the loss, the others learn it from the backward messages. With "raise", the last
        # rank raises NonFiniteLoss and the others a PeerError that carries it.
        for algorithm in sys.argv[3].split(","):
            pipe = make_pipeline(world, algorithm, timeout=60, on_nonfinite="skip")
            losses = train(pipe, poisoned_batches(), first, last)
            torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"skip-{algorithm}-{rank}.pt"))
        pipe = make_pipeline(world, "pipedream", timeout=5)
        try:
            train(pipe, poisoned_batches(), first, last)
        except (pipecore.NonFiniteLoss, pipecore.PeerError) as exc:
            with open(os.path.join(out, f"raise-{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
    elif mode == "cause":
        # One rank's action raises (a forward or a backward, at its `at`-th call); every rank writes the error
        # it raised. The others must name the cause, well before the (long) timeout.
        failing, kind, at = int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        pipe = make_pipeline(world, "pipedream", timeout=120)
        if rank == failing:
            stage = pipe.stages[rank]
            name = "compute_forward" if kind == "F" else "compute_backward"
            original, calls = getattr(stage, name), [0]

            def failing_hook(action, *args):
                calls[0] += 1
                if calls[0] == at:
                    raise RuntimeError(f"injected failure in {action}")
                return original(action, *args)

            setattr(stage, name, failing_hook)
        try:
            train(pipe, batches(STEPS), first, last)
            message = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
            message = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(out, f"cause-{rank}.txt"), "w") as f:
            f.write(message)
    elif mode == "recover":
        # Every (algorithm, failing rank, action kind) of RECOVER_CASES: that rank's first action of the kind
        # for the newest mini-batch given after RECOVER_ARM steps raises after its compute. Each rank trains
        # on data[pipe.minibatches] until every batch is kept, so the undone mini-batches are given again.
        for algorithm, failing, kind in RECOVER_CASES:
            pipe = make_pipeline(world, algorithm, timeout=60)
            record = train_through_failure(pipe, batches(STEPS + 2), kind if rank == failing else None, first, last)
            torch.save(record, os.path.join(out, f"recover-{algorithm}-{failing}-{kind}-{rank}.pt"))
            pipe.close()
    elif mode == "recover-clip":
        # The same with global-norm clipping (gpipe, 1f1b): a rank waiting for another's gradient norm learns of
        # a failure from a notice on the norms' stream, and the streams are taken back with the rest.
        for algorithm, failing, kind in RECOVER_CLIP_CASES:
            pipe = make_pipeline(world, algorithm, timeout=20, clip_grad_norm=CLIP)
            record = train_through_failure(pipe, batches(STEPS + 2), kind if rank == failing else None, first, last)
            torch.save(record, os.path.join(out, f"recover-clip-{algorithm}-{failing}-{kind}-{rank}.pt"))
            pipe.close()
    elif mode == "recover-gpt":
        # The same with a GPT whose head is tied to its embedding (on the first and last rank), for every case
        # of RECOVER_GPT_CASES: the tied gradients' exchange is taken back with the rest. A short timeout: no
        # rank may wait for one (an owner waiting for the other's tied gradient learns of a failure at once).
        for algorithm, failing, kind in RECOVER_GPT_CASES:
            pipe = make_gpt_pipeline(world, algorithm, timeout=20)
            record = train_through_failure(pipe, gpt_batches(STEPS + 2), kind if rank == failing else None,
                                           first, last)
            torch.save(record, os.path.join(out, f"recover-gpt-{algorithm}-{failing}-{kind}-{rank}.pt"))
            pipe.close()
    elif mode == "ties-undo":
        ties_undo(rank, out)
    elif mode == "ties-last":
        ties_last_message(rank, out)
    elif mode == "die":
        timeout, how = float(sys.argv[3]), sys.argv[4]
        pipe = make_pipeline(world, "pipedream", timeout=timeout)
        data = batches(STEPS)
        if rank == 1:
            pipe.step(data[0][0] if first else None, data[0][1] if last else None)
            if how == "stall":
                time.sleep(3 * timeout)  # alive, connections open, but silent: only the timeout can tell
            os._exit(0)  # dies mid-run, without a word to its neighbours (its last sends may be lost too)
        start = time.monotonic()
        try:
            for x, y in data:
                pipe.step(x if first else None, y if last else None)
            pipe.flush()
        except pipecore.PeerError as exc:
            with open(os.path.join(out, f"error-{rank}.txt"), "w") as f:
                f.write(f"{time.monotonic() - start:.3f}\n{exc}")
    elif mode == "exit":
        # No flush: the last rank returns from its last step and exits at once, while rank 0 is still
        # late for its last step; what the last rank queued (gradients, the loss) must still arrive.
        pipe = make_pipeline(world, "1f1b", timeout=60)
        losses = []
        for i, (x, y) in enumerate(batches(STEPS)):
            if i == STEPS - 1 and first:
                time.sleep(1.0)  # the last rank's last sends are still outstanding when it exits
            losses.append(pipe.step(x if first else None, y if last else None))
        torch.save(losses, os.path.join(out, f"losses-{rank}.pt"))
    elif mode == "held":
        # A long run without flush: the sends each rank holds (waiting for the neighbour's acknowledgement)
        # must stay bounded by the micro-batches in flight, not grow with the steps.
        pipe = make_pipeline(world, sys.argv[3], timeout=60)
        held = []
        for x, y in batches(int(sys.argv[4])):
            pipe.step(x if first else None, y if last else None)
            held.append(pipe._parts.transport.links.held())
        pipe.flush()
        held.append(pipe._parts.transport.links.held())
        torch.save(held, os.path.join(out, f"held-{rank}.pt"))
    elif mode == "posted":
        # Each rank keeps receives posted on every incoming link between steps and across a flush, so the
        # neighbour's next messages never wait for their receives to be posted.
        pipe = make_pipeline(world, "1f1b", timeout=60)
        posted = []
        for i, (x, y) in enumerate(batches(3)):
            pipe.step(x if first else None, y if last else None)
            if i == 1:
                pipe.flush()
            posted.append({f"{stream.key[0].name}{stream.key[1]}": stream.posted
                           for stream in pipe._parts.transport.links.incoming if stream.key != "loss" and stream.posted})
        torch.save(posted, os.path.join(out, f"posted-{rank}.pt"))
    elif mode == "close":
        # Pipelines built and closed one after another (a sweep in one job): closing releases each one's
        # process groups and their threads, and the next pipeline trains as the first did.
        def threads() -> int:
            return len(os.listdir("/proc/self/task"))

        record: dict = {"losses": [], "threads": []}
        for i in range(3):
            if i == 0:
                pipe = make_pipeline(world, "2bw", timeout=60)
                record["losses"].append(train(pipe, batches(2), first, last))
                pipe.close()
            else:
                with make_pipeline(world, "2bw", timeout=60) as pipe:
                    record["losses"].append(train(pipe, batches(2), first, last))
            record["threads"].append(threads())
        try:
            pipe.step(None, None)
        except RuntimeError as exc:
            record["error"] = str(exc)
        torch.save(record, os.path.join(out, f"close-{rank}.pt"))
    elif mode == "links":
        # Each link (neighbour and direction) is its own two-rank process group.
        import torch.distributed as dist

        pipe = make_pipeline(world, "1f1b", timeout=60)
        train(pipe, batches(1), first, last)
        # Links are the streams named by (kind, boundary b between stages b and b+1); one stage per rank here.
        links = [s for s in [*pipe._parts.transport.links.outgoing, *pipe._parts.transport.links.incoming] if s.key != "loss"]
        record = {(s.key[0].name, s.key[1] + 1 if rank == s.key[1] else s.key[1]):
                  (sorted(dist.get_process_group_ranks(s.group)), s.peer) for s in links}
        groups = [s.group for s in links]
        record["distinct"] = len({id(g) for g in groups}) == len(groups) and dist.group.WORLD not in groups
        torch.save(record, os.path.join(out, f"links-{rank}.pt"))
    elif mode == "destroy":
        # The usual end of a script: destroy the process groups while the pipeline is still referenced,
        # then exit normally.
        import torch.distributed as dist

        pipe = make_pipeline(world, "2bw", timeout=300)
        losses = train(pipe, batches(2), first, last)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, losses)  # other traffic on the default group, as a script has
        dist.destroy_process_group()
        torch.save(losses, os.path.join(out, f"losses-{rank}.pt"))
        errors = []  # what needs the other ranks afterwards says why it cannot run
        for gather in (pipe.full_state_dict, lambda: checkpoint.save(pipe, os.path.join(out, "late"))):
            try:
                gather()
            except RuntimeError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        with open(os.path.join(out, f"late-{rank}.txt"), "w") as f:
            f.write("\n".join(errors))
    elif mode == "save":
        # Saving is collective: a rank with backwards in flight, or a directory that rank 0 cannot see the
        # other ranks' files in, fails the save on every rank at once (no rank waits for another), and
        # nothing is committed.
        timeout = 5.0
        pipe = make_pipeline(world, "pipedream", timeout=timeout)
        x, y = batches(1)[0]
        pipe.step(x if first else None, y if last else None)
        errors = {}
        try:
            checkpoint.save(pipe, os.path.join(out, "in-flight"))
        except checkpoint.CheckpointError as exc:
            errors["in-flight"] = str(exc)
        pipe.flush()
        try:
            checkpoint.save(pipe, os.path.join(out, f"unshared-{rank}"))  # as if each rank had its own disk
        except checkpoint.CheckpointError as exc:
            errors["unshared"] = str(exc)
        checkpoint.save(pipe, os.path.join(out, "shared"))
        # A rank that does not take part: the others give up after the pipeline's timeout.
        if rank == 0:
            start = time.monotonic()
            try:
                checkpoint.save(pipe, os.path.join(out, "alone"))
            except checkpoint.CheckpointError as exc:
                errors["alone"] = (time.monotonic() - start, str(exc))
        else:
            time.sleep(timeout + 3)
        torch.save(errors, os.path.join(out, f"save-{rank}.pt"))
    elif mode == "predict":
        # Predictions between steps (micro-batches in flight for the asynchronous algorithms): the last rank's
        # result, then the same with broadcast=True on every rank; the training goes on around them.
        for case in PREDICT_CASES:
            pipe, data, inputs = predict_case(world, case, timeout=60)
            losses, at_last, shared = [], [], []
            for i, (x, y) in enumerate(data):
                losses.append(pipe.step(x if first else None, y if last else None))
                at_last.append(pipe.predict(inputs(i) if first else None))
                shared.append(pipe.predict(inputs(i) if first else None, broadcast=True))
            pipe.flush()
            torch.save({"losses": losses, "state": pipe.state_dict(), "last": at_last, "broadcast": shared},
                       os.path.join(out, f"predict-{case}-{rank}.pt"))
        # Ranks that disagree on broadcast: every rank follows rank 0's, and the others say so afterwards.
        record = {"mismatch": None, "mismatched": None}
        try:
            record["mismatched"] = pipe.predict(inputs(STEPS) if first else None, broadcast=first)
        except ValueError as exc:
            record["mismatch"] = str(exc)
        losses = train(pipe, data[:1], first, last)  # and training goes on
        torch.save({**record, "losses": losses}, os.path.join(out, f"predict-mismatch-{rank}.pt"))
    elif mode == "mismatch":
        try:
            make_pipeline(world + 1, "1f1b")
        except ValueError as exc:
            with open(os.path.join(out, f"error-{rank}.txt"), "w") as f:
                f.write(str(exc))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
