"""Which weight versions each instance holds, as its loads reported: one record for all of serve.

The instance lifecycle writes it (a new instance holds version 0; a finished load, an unload, a
load a roll-back superseded), the trainer's roll-back forgets the ghost versions in it, and every
other part reads it. It is what the instances hold now, apart from the orchestrator's plan (which
version each instance is to hold, and whether it is ready for it) and from the instances
themselves (the vLLM client labels its server's weights for its own pinned calls).

A single-version instance holds one version, or none known (`newest` is -1: a load was cut short
or made a ghost by a roll-back, so whatever it holds must be loaded again). A multi-version
instance (LoRA adapters over one base) holds several; `newest` is the newest of them.
"""

from __future__ import annotations

__all__ = ["InstanceVersions"]


class InstanceVersions:
    """The versions each instance holds (see the module docstring)."""

    def __init__(self, *, multi_version: bool) -> None:
        self._multi = multi_version
        self._held: dict[str, set[int]] = {}

    @property
    def multi_version(self) -> bool:
        """Whether the instances hold several versions at once (LoRA adapters)."""
        return self._multi

    def add(self, instance: str) -> None:
        """A new instance: it holds the initial weights, version 0."""
        self._held[instance] = {0}

    def holds(self, instance: str, version: int) -> bool:
        return version in self._held[instance]

    def held(self, instance: str) -> frozenset[int]:
        return frozenset(self._held[instance])

    def newest(self, instance: str) -> int:
        """The newest version the instance holds; -1 when none is known."""
        return max(self._held[instance], default=-1)

    def loaded(self, instance: str, version: int) -> None:
        """A load of `version` finished: beside the others on a multi-version instance, in their
        place on any other."""
        if self._multi:
            self._held[instance].add(version)
        else:
            self._held[instance] = {version}

    def dropped(self, instance: str, version: int) -> None:
        """An unload: the instance no longer holds `version` (for the lease counts at once; the
        adapter may still be dropping)."""
        held = self._held.get(instance)
        if held is not None:
            held.discard(version)

    def spoiled(self, instance: str, version: int) -> None:
        """A load of `version` ended after a roll-back superseded it, so `version` may name other
        weights now: that adapter is not held, and a single-version instance holds nothing
        known."""
        if self._multi:
            self._held[instance].discard(version)
        else:
            self._held[instance] = set()

    def forget_newer(self, newest: int) -> None:
        """A roll-back: versions above `newest` are ghosts, held by no instance any more."""
        for instance, held in self._held.items():
            self._held[instance] = {v for v in held if v <= newest}
