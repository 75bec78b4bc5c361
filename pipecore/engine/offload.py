"""Offloaded segments: parts of a stage whose saved activations wait in pinned host memory for the backward.

A plan (``pipecore.plan``, on a CUDA profile) may offload node ranges ``[i, j)`` of a stage. Each range becomes
an :class:`Offloaded` module in the stage's generated graph:

* its forward runs the segment with saved-tensor hooks that wrap the stage's own (saved weights stay
  references, see :mod:`pipecore.engine.saved`); every tensor its nodes save other than a weight or buffer
  is taken whole, one copy per storage however many views of it are saved;
* when the segment's forward ends, each storage is copied to pinned host memory on a side CUDA stream, after
  the work that wrote it, and the device reference is dropped: the allocator reuses the memory once the
  copy has read it (``record_stream``), while the stage computes on. A saved tensor changed in place since
  its save raises there, as autograd would in the backward (it cannot check tensors that hooks packed);
* when the gradient of the segment's outputs arrives in the backward, every storage is copied back on the
  side stream at once (a prefetch), and each node's backward waits for the copy of what it saved (a CUDA
  event), never the host. A storage not prefetched (no gradient reached the outputs first) is copied back
  when its node asks for it.

What the segment keeps on the device is nothing but the copies in flight; what it moves includes storages
the stage holds anyway (its inputs and outputs): those are not freed, and the planner's model counts them
moved but not freed. On a CPU stage offload does not apply: there is no separate host memory to move to.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from .saved import outer_hooks, saving
from .segments import replace_segments


class Link(Protocol):
    """Moves bytes between a device and host memory (:class:`HostLink` on CUDA)."""

    def to_host(self, data: torch.Tensor) -> torch.Tensor:
        """Start copying ``data`` to host memory and return the host buffer; ``data`` may be freed at once."""

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` back; return the device buffer and what :meth:`wait` waits for."""

    def wait(self, ready: Any, data: torch.Tensor) -> None:
        """Make the computation that reads ``data`` wait for its copy (``ready``)."""


class HostLink:
    """Copies between one CUDA device and pinned host memory on a side stream, shared by the device's stages."""

    _links: dict[torch.device, "HostLink"] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"activation offload moves saved tensors from a CUDA device to pinned host memory; "
                             f"{device} is not a CUDA device")
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def of(cls, device: torch.device) -> "HostLink":
        """The link of ``device`` (one side stream per device)."""
        with cls._lock:
            if device not in cls._links:
                cls._links[device] = cls(device)
            return cls._links[device]

    def to_host(self, data: torch.Tensor) -> torch.Tensor:
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the work that wrote it
        with torch.cuda.stream(self.stream):
            host.copy_(data, non_blocking=True)
        data.record_stream(self.stream)  # its memory is not reused before the copy has read it
        return host

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # Allocated for the side stream, which writes it; the stream that reads it is recorded in wait().
        with torch.cuda.stream(self.stream):
            data = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            data.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return data, ready

    def wait(self, ready: Any, data: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)
        data.record_stream(stream)


class _StorageCopy:
    """One storage saved in a segment: on the device until the segment's forward ends, then on the host,
    then on the device again for the backward."""

    __slots__ = ("data", "host", "ready", "link", "saved")

    def __init__(self, data: torch.Tensor):
        self.data: torch.Tensor | None = data  # the storage's bytes (uint8) while on the device
        self.host: torch.Tensor | None = None
        self.ready: Any = None
        self.link: Link | None = None
        self.saved: list[tuple[torch.Tensor, int]] = []  # the tensors saved from it, with their versions then

    def offload(self, link: Link) -> None:
        assert self.data is not None
        # Autograd cannot check the versions of tensors that hooks packed: check them here, before the copy,
        # so that an in-place change after a save raises as it does without offload (not a wrong gradient).
        for t, version in self.saved:
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation inside an offloaded segment: a {t.dtype} tensor of shape {list(t.shape)} was saved "
                    f"at version {version} and is now at version {t._version}")
        self.saved = []
        self.link, self.host, self.data = link, link.to_host(self.data), None

    def prefetch(self) -> None:
        if self.data is None and self.host is not None and self.link is not None:
            self.data, self.ready = self.link.to_device(self.host)
            self.host = None

    def device_bytes(self) -> torch.Tensor:
        self.prefetch()
        assert self.data is not None, "a saved storage was neither offloaded nor kept"
        if self.ready is not None and self.link is not None:
            self.link.wait(self.ready, self.data)
            self.ready = None
        return self.data


class _Saved:
    """What autograd keeps for a tensor saved in an offloaded segment: its storage's copy and its view."""

    __slots__ = ("copy", "dtype", "size", "stride", "offset")

    def __init__(self, copy: _StorageCopy, t: torch.Tensor):
        self.copy, self.dtype = copy, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def restore(self) -> torch.Tensor:
        return self.copy.device_bytes().view(self.dtype).as_strided(self.size, self.stride, self.offset)


class _Region:
    """One forward of one offloaded segment (one micro-batch): the storages its nodes saved."""

    def __init__(self, kept: set[int], device: torch.device | None):
        self.kept = kept  # storages never offloaded: the segment's weights and buffers
        self.device = device  # the segment's: a tensor elsewhere (a CPU scalar) stays where it is
        self.copies: dict[int, _StorageCopy] = {}
        self.offloaded: list[_StorageCopy] = []

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided or t.numel() == 0 or t.device != self.device:
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.kept or storage.nbytes() % t.element_size():
            return t
        copy = self.copies.get(key)
        if copy is None:  # held until the forward ends, so that no other storage takes its address meanwhile
            copy = self.copies[key] = _StorageCopy(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        copy.saved.append((t, t._version))
        return _Saved(copy, t)

    def seal(self, link_of: Callable[[torch.device], Link]) -> None:
        """The segment's forward has ended: start moving what it saved to the host."""
        for copy in self.copies.values():
            assert copy.data is not None
            copy.offload(link_of(copy.data.device))
        self.offloaded = list(self.copies.values())
        self.copies = {}

    def prefetch(self) -> None:
        """The backward has reached the segment: bring everything back (once)."""
        offloaded, self.offloaded = self.offloaded, []
        for copy in offloaded:
            copy.prefetch()


class Offloaded(nn.Module):
    """A segment of a stage's graph whose saved activations are offloaded (see the module docstring).

    ``link`` gives the :class:`Link` of a device (default :meth:`HostLink.of`, CUDA only)."""

    def __init__(self, segment: fx.GraphModule, link: Callable[[torch.device], Link] | None = None):
        super().__init__()
        self.segment = segment
        self.link = link if link is not None else HostLink.of

    def forward(self, *inputs: Any) -> Any:
        held = [t for m in self.segment.modules() for t in (*m._parameters.values(), *m._buffers.values())
                if t is not None]
        device = next((t.device for t in (*tree_leaves(inputs), *held) if isinstance(t, torch.Tensor)), None)
        region = _Region({t.untyped_storage().data_ptr() for t in held}, device)
        outer_pack, outer_unpack = outer_hooks()

        def pack(t: torch.Tensor) -> Any:
            packed = outer_pack(t)  # the stage's: a saved weight may become a reference
            return region.pack(packed) if isinstance(packed, torch.Tensor) else packed

        def unpack(packed: Any) -> torch.Tensor:
            return outer_unpack(packed.restore() if isinstance(packed, _Saved) else packed)

        with saving(pack, unpack):
            outputs = self.segment(*inputs)
        region.seal(self.link)
        with_grad = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if with_grad and region.offloaded:
            torch.autograd.graph.register_multi_grad_hook(with_grad, lambda _grad: region.prefetch(), mode="any")
        return outputs


def offload_segments(gm: fx.GraphModule, segments: Any, link: Callable[[torch.device], Link] | None = None) -> None:
    """Rewrite ``gm`` (a stage's generated module) so that each segment, a run of consecutive compute nodes
    named in order, is one :class:`Offloaded` call whose outputs replace the segment's values."""
    replace_segments(gm, segments, lambda segment: Offloaded(segment, link), "offloaded")
