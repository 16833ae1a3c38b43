"""Checkpoints with orbax: async saves, retention, atomic finalisation, restore onto any mesh.

A checkpoint holds the TrainState, the loader's (small, JSON) state and, for placements that plan
their own buffers (the multiplexer's encoder capacities), the placement's state: a resumed run then
places every step as the uninterrupted run did. orbax writes each step
to a temporary directory and renames it when complete, so an interrupted save never becomes the
latest. Restoring takes an abstract target whose leaves carry the *new* shardings, so a job can
be resized by stop-and-restore.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with each leaf's current sharding: the restore target for this layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


class Checkpointer:
    def __init__(self, directory: Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, loader_state: dict | None = None, *,
             placement_state: dict | None = None, force: bool = False) -> bool:
        items = {"state": ocp.args.StandardSave(state), "loader": ocp.args.JsonSave(loader_state or {})}
        if placement_state:
            items["placement"] = ocp.args.JsonSave(placement_state)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore onto the shardings carried by `target` (arrays or ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else abstract_like(x), target)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), loader=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["loader"] or {}), step

    def placement_state(self, step: int) -> dict:
        """The placement's state saved with `step` ({} for checkpoints saved without one)."""
        if not (self.directory / str(step) / "placement").exists():
            return {}
        restored = self._manager.restore(step, args=ocp.args.Composite(placement=ocp.args.JsonRestore()))
        return dict(restored["placement"] or {})

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
