"""What both sides of vLLM's NCCL weight transfer must agree on: the group, and what one
broadcast carries in which order.

The group holds trainer rank 0 (rank 0) and every worker of every vLLM instance in it: instance
`i` with tensor parallelism `tp` takes ranks `1 + i * tp .. (i + 1) * tp`, and
`world_size = 1 + instances * tp`. Trainer rank 0 listens at `master_address:master_port` (vLLM's
`StatelessProcessGroup` rendezvous); every worker connects there.

A broadcast sends one tensor at a time (vLLM's unpacked receive: it allocates each tensor from
`names`, `dtype_names` and `shapes`, receives it, and loads it), in the order of the names sorted.
The order is a rule rather than a message: trainer rank 0 broadcasts the tensors it published for
the version, sorted by name, and serve builds the update from the same version as its weight store
holds it (names, dtypes, shapes), sorted the same way, so neither side needs the other's list.
The module is pure: dataclasses and sorting, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TransferGroup", "UpdateInfo", "broadcast_order"]

Json = dict[str, object]


def broadcast_order(names: Sequence[str]) -> list[str]:
    """The order in which the tensors `names` are broadcast (both sides use it)."""
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice in one version")
    return sorted(names)


@dataclass(frozen=True, kw_only=True)
class TransferGroup:
    """The NCCL group of trainer rank 0 and `instances` servers of `tensor_parallel` workers."""

    master_address: str
    master_port: int
    instances: int
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if self.instances < 1 or self.tensor_parallel < 1:
            raise ValueError(
                f"a group needs instances >= 1 and tensor_parallel >= 1, not "
                f"{self.instances} and {self.tensor_parallel}"
            )

    @property
    def world_size(self) -> int:
        return 1 + self.instances * self.tensor_parallel

    def ranks(self, index: int) -> range:
        """The ranks of instance `index`'s workers."""
        first = 1 + index * self.tensor_parallel
        return range(first, first + self.tensor_parallel)

    def init_info(self, index: int) -> Json:
        """The body of instance `index`'s `POST /init_weight_transfer_engine`: exactly the
        fields of vLLM's NCCL init info (it refuses any other)."""
        return {
            "init_info": {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": self.ranks(index).start,
                "world_size": self.world_size,
            }
        }


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """What one broadcast carries, in its order (`broadcast_order`)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(
        cls, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> UpdateInfo:
        """The update of one version's tensors (given in any order), in broadcast order;
        dtypes as torch names ("bfloat16"; a "torch." prefix is dropped)."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        at = {name: i for i, name in enumerate(names)}
        order = broadcast_order(names)
        return cls(
            names=order,
            dtype_names=[dtypes[at[n]].removeprefix("torch.") for n in order],
            shapes=[[int(d) for d in shapes[at[n]]] for n in order],
        )

    def body(self) -> Json:
        """The body of `POST /update_weights`: one tensor per broadcast (`packed` off)."""
        return {
            "update_info": {
                "names": self.names,
                "dtype_names": self.dtype_names,
                "shapes": self.shapes,
                "packed": False,
            }
        }
