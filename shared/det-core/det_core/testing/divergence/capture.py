"""Recording one run of a step: every module call's inputs and outputs through PyTorch's global
module hooks (``_Run``), each recorded tensor hashed piece by piece across micro-batches
(``_Stream``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from .._nested import nested_leaves
from .report import _where


class _Stream:
    """One recorded tensor across a run: its pieces (one per call) hashed in order, joined on demand."""

    __slots__ = ("hasher", "dtypes", "shapes", "batched", "pieces")

    def __init__(self, keep: bool) -> None:
        self.hasher = hashlib.sha256()
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []  # per piece, with the batch dim moved first
        self.batched: list[bool] = []
        self.pieces: list[torch.Tensor] | None = [] if keep else None

    def add(self, t: torch.Tensor, batch_dim: int | None, where: str) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"find_divergence: {where} is a {type(t).__name__} (a tensor subclass); only plain tensors "
                "can be compared: run the step without the wrapper (no DTensor / FSDP / compile) "
                "for the search"
            )
        batched = batch_dim is not None and t.dim() > batch_dim
        piece = t.detach().movedim(batch_dim, 0) if batched else t.detach()
        # a copy when kept: the step may change the tensor in place after the hook
        piece = piece.to("cpu", copy=self.pieces is not None).contiguous()
        self.hasher.update(piece.reshape(-1).view(torch.uint8).numpy())
        self.dtypes.append(piece.dtype)
        self.shapes.append(tuple(piece.shape))
        self.batched.append(batched)
        if self.pieces is not None:
            self.pieces.append(piece)

    @property
    def joins(self) -> bool:
        """Whether the pieces join into one global tensor along the batch dim."""
        return all(self.batched) and len({s[1:] for s in self.shapes}) == 1 and len(set(self.dtypes)) == 1

    @property
    def stacks(self) -> bool:
        """Whether the pieces are batch-free tensors of one shape and dtype (stacked when several)."""
        return not any(self.batched) and len(set(self.shapes)) == 1 and len(set(self.dtypes)) == 1

    def global_shape(self, batch_dim: int | None) -> tuple:
        if self.joins:
            shape = [sum(s[0] for s in self.shapes), *self.shapes[0][1:]]
            shape.insert(batch_dim, shape.pop(0))
            return tuple(shape)
        if self.stacks:
            return self.shapes[0] if len(self.shapes) == 1 else (len(self.shapes), *self.shapes[0])
        return tuple(self.shapes)  # not one tensor: the pieces' shapes

    def global_tensor(self, batch_dim: int | None) -> torch.Tensor | None:
        if self.pieces is None:
            return None
        if self.joins:
            return torch.cat(self.pieces, 0).movedim(0, batch_dim)
        if self.stacks:
            return self.pieces[0] if len(self.pieces) == 1 else torch.stack(self.pieces)
        return None


class _Run:
    """The module calls of one step, recorded by global forward hooks (pre: inputs, post: outputs)."""

    def __init__(self, model: torch.nn.Module, batch_dim: int, keep: Callable[[str], bool]) -> None:
        self.model = model
        self.batch_dim = batch_dim
        self.keep = keep
        self.names: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(module), name)
        self.micro_batches = 0
        self.sizes: list[int | None] = []  # batch_dim size of each micro-batch's first tensor input
        self.uses: dict[str, int] = {}  # calls per module name in the current micro-batch
        self.stack: list[tuple[int, str, int]] = []  # (id(module), name, call) of the open calls
        self.outputs: dict[tuple[str, int, str], _Stream] = {}  # insertion order = forward order
        self.inputs: dict[tuple[str, int, str], _Stream] = {}
        self.alive: list[torch.nn.Module] = []  # unregistered modules kept alive: their ids stay unique

    def _name(self, module: torch.nn.Module) -> str:
        name = self.names.get(id(module))
        if name is None:
            name = f"<unregistered {type(module).__qualname__}>"
            self.alive.append(module)
        return name

    def pre_hook(self, module, args) -> None:
        if module is self.model and not self.stack:
            self.micro_batches += 1
            self.uses.clear()
            first = next((t for _, t in nested_leaves(tuple(args)) if isinstance(t, torch.Tensor)), None)
            self.sizes.append(
                first.shape[self.batch_dim] if first is not None and first.dim() > self.batch_dim else None
            )
        name = self._name(module)
        call = self.uses.get(name, 0)
        self.uses[name] = call + 1
        self.stack.append((id(module), name, call))
        for path, t in nested_leaves(tuple(args)):
            if isinstance(t, torch.Tensor):
                key = (name, call, path)
                self.inputs.setdefault(key, _Stream(keep=False)).add(
                    t, self.batch_dim, f"input {path} of {_where('output', name, call, '')}"
                )

    def post_hook(self, module, args, output) -> None:
        while self.stack:  # a forward that raised inside leaves its entries: drop them
            ident, name, call = self.stack.pop()
            if ident == id(module):
                break
        else:
            return  # a call that began before the hooks were installed
        keep = self.keep(name)
        for path, t in nested_leaves(output):
            if isinstance(t, torch.Tensor):
                key = (name, call, path)
                stream = self.outputs.get(key)
                if stream is None:
                    stream = self.outputs[key] = _Stream(keep)
                stream.add(t, self.batch_dim, _where("output", name, call, path))
