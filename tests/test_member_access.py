"""Generated stage modules reach their members through descriptors (pipecore.engine.member_access): the same
objects as nn.Module's own lookup, at every moment, on that module only."""

import pytest
import torch
from torch import fx, nn

from pipecore.engine.member_access import speed_up_member_access


class _Scaled(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _traced() -> fx.GraphModule:
    return fx.symbolic_trace(_Scaled())


def test_members_are_nn_modules_own_and_follow_changes():
    gm = _traced()
    speed_up_member_access(gm)
    cls = type(gm)
    assert {"0", "1", "2", "scale"} <= set(vars(cls))  # descriptors on the per-instance class
    assert getattr(gm, "0") is gm._modules["0"] and gm.scale is gm._buffers["scale"]
    x = torch.randn(5, 3)
    torch.testing.assert_close(gm(x), gm.forward(x))
    # Replaced by add_module, setattr, or a parameter swapped into the dict: the descriptor reads the dict.
    new = nn.Linear(4, 2)
    gm.add_module("2", new)
    assert getattr(gm, "2") is new
    other = nn.Tanh()
    setattr(gm, "1", other)
    assert getattr(gm, "1") is other
    swapped = torch.zeros(4, 3)
    linear = getattr(gm, "0")
    gm.add_module("0", linear)
    linear._parameters["weight"] = swapped
    assert getattr(gm, "0").weight is swapped
    # Removed: nn.Module's own error, and hasattr is False.
    delattr(gm, "1")
    assert not hasattr(gm, "1")
    with pytest.raises(AttributeError, match="has no attribute '1'"):
        getattr(gm, "1")
    # A plain attribute set under a member's name after it is gone wins, as for any instance attribute.
    gm.__dict__["1"] = "plain"
    assert getattr(gm, "1") == "plain"


def test_other_modules_and_classes_untouched():
    gm, twin = _traced(), _traced()
    speed_up_member_access(gm)
    assert "0" not in vars(type(twin))  # each GraphModule has a class of its own
    assert "0" not in vars(nn.Sequential) and "0" not in vars(_Scaled) and "weight" not in vars(nn.Linear)
    # A user module inside is left as it is (its class is shared).
    speed_up_member_access(nn.Sequential(nn.Linear(2, 2)))
    assert "0" not in vars(nn.Sequential)


def test_members_never_shadow_class_attributes():
    model = nn.Sequential(nn.Linear(2, 2))
    gm = fx.symbolic_trace(model)
    gm.add_module("forward_hooks_holder", nn.Identity())
    gm.register_buffer("training_steps", torch.zeros(()))
    speed_up_member_access(gm)
    # Members are added only under names the class does not have: a method stays a method.
    assert "forward_hooks_holder" in vars(type(gm)) and "training_steps" in vars(type(gm))
    assert callable(type(gm).__dict__["forward"]) and not hasattr(type(gm).__dict__["forward"], "where")
    assert gm.training_steps is gm._buffers["training_steps"]
    gm2 = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    gm2.register_buffer("cuda_fake", torch.zeros(()))
    gm2._buffers["training"] = torch.zeros(())  # a member under a name nn.Module itself uses
    speed_up_member_access(gm2)
    assert "training" not in vars(type(gm2)) and gm2.training is True
