"""Checkpoints with orbax: async saves, retention, atomic finalisation, checksums, restore onto any mesh.

A checkpoint holds the TrainState, the loader's (small, JSON) state and, for placements that plan
their own buffers (the multiplexer's encoder capacities), the placement's state: a resumed run then
places every step as the uninterrupted run did. orbax writes each step
to a temporary directory and renames it when complete, so an interrupted save never becomes the
latest. Restoring takes an abstract target whose leaves carry the *new* shardings, so a job can
be resized by stop-and-restore.

Checksums: bytes that change after a save (a truncated file, a disk that flips bits, a copy cut
short) must never be loaded silently. When an async save has written every process's files, and
before orbax renames the temporary folder into place, process 0 writes `omnijax_checksums.json`
(size and SHA-256 of every file) into it, so the checksums are committed with the checkpoint in the
same rename. `verify(step)` checks them before any value is read; `set_aside(step)` moves a damaged
step out of the way (renamed, never deleted) so the run can resume from an older one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from omnijax.errors import UserError

CHECKSUMS = "omnijax_checksums.json"
SET_ASIDE = "set_aside"          # run_dir/checkpoints/../checkpoints_set_aside/<step>[.n]
_TMP = ".orbax-checkpoint-tmp"
# orbax rewrites these after the commit (timestamps, a commit marker): not covered by the checksums
_MUTABLE = {CHECKSUMS, "_CHECKPOINT_METADATA", "commit_success.txt"}


class _DroppedWriteErrors(logging.Filter):
    """A failed orbax write is logged with a traceback by each background thread and asyncio gather it
    passes through; the failure is reported once, as CheckpointSaveError (one line), so these are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        orbax_trace = record.levelno >= logging.ERROR and "/orbax/" in record.pathname and (
            record.exc_info or "raised an exception" in str(record.msg))
        return not (orbax_trace or "exception was never retrieved" in str(record.msg))


logging.getLogger("asyncio").addFilter(_DroppedWriteErrors())
logging.getLogger("absl").addFilter(_DroppedWriteErrors())


class CheckpointSaveError(UserError):
    """A save failed (unwritable folder, disk full, a lost peer): the earlier checkpoints are intact.
    `cause` keeps the underlying error's text, so a save broken by a lost process is told from a disk fault."""

    def __init__(self, message: str, cause: str = ""):
        super().__init__(message)
        self.cause = cause


class DamagedCheckpoint(Exception):
    """A step whose files disagree with its checksums (or that orbax could not read)."""


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with each leaf's current sharding: the restore target for this layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksum_tree(folder: Path) -> dict:
    """{relative path: [bytes, sha256]} of every file under `folder` (but orbax's own step metadata)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            p = Path(root) / name
            rel = p.relative_to(folder).as_posix()
            if rel not in _MUTABLE:
                out[rel] = [p.stat().st_size, _sha256(p)]
    return out


def verify_tree(folder: Path) -> str | None:
    """None if every file listed in FOLDER/omnijax_checksums.json has its size and hash; else what failed."""
    listing = folder / CHECKSUMS
    if not listing.exists():
        return "no checksum file (saved by an older omnijax, or cut short)"
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{CHECKSUMS} is unreadable"
    for rel, (size, digest) in sorted(files.items()):
        p = folder / rel
        if not p.exists():
            return f"{rel} is missing"
        have = p.stat().st_size
        if have != size:
            return f"{rel} has {have} bytes, {size} were written"
        if _sha256(p) != digest:
            return f"{rel} has the right size but different bytes (checksum mismatch)"
    return None


class Checkpointer:
    def __init__(self, directory: Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.async_save = async_save
        self._saving: int | None = None      # the step an async save is writing
        self.checksum_s: list[float] = []     # seconds spent hashing each save (background thread)
        self.verify_s = 0.0                   # seconds spent checking the restored step's checksums
        async_options = ocp.AsyncOptions(post_finalization_callback=self._write_checksums) if async_save else None
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True, async_options=async_options,
                                               cleanup_tmp_directories=True)  # saves cut short by a kill
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as exc:
            raise CheckpointSaveError(f"cannot create the checkpoint folder {self.directory}: "
                                      f"{exc.strerror or exc}; choose a writable place (OMNIJAX_RUNS)") from None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    # -------------------------------------------------------------------------------- saving
    def save(self, step: int, state: Any, loader_state: dict | None = None, *,
             placement_state: dict | None = None, force: bool = False) -> bool:
        """Start saving `step` (async). A failure of this save or of the previous one's background part
        raises CheckpointSaveError naming the folder; the checkpoints already committed stay readable."""
        items = {"state": ocp.args.StandardSave(state), "loader": ocp.args.JsonSave(loader_state or {})}
        if placement_state:
            items["placement"] = ocp.args.JsonSave(placement_state)
        self.wait()  # surfaces a failed previous save here, with its step, before starting another
        self._saving = step
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        except Exception as exc:  # noqa: BLE001 - orbax wraps OSErrors in several types
            raise self._save_error(step, exc) from None
        if saved and not self.async_save and jax.process_index() == 0:
            self._write_listing(self.directory / str(step))
        return saved

    def _write_checksums(self) -> None:
        """orbax's post-finalisation callback (process 0, all processes' files written, before the commit
        rename): checksum the step's temporary folder so the listing is committed with it."""
        step = self._saving
        tmp = sorted(self.directory.glob(f"{step}{_TMP}*"), key=lambda p: p.stat().st_mtime)
        target = tmp[-1] if tmp else self.directory / str(step)  # filesystems without renames write in place
        self._write_listing(target)

    def _write_listing(self, folder: Path) -> None:
        t0 = time.perf_counter()
        listing = {"format": 1, "files": checksum_tree(folder)}
        tmp = folder / (CHECKSUMS + ".tmp")
        tmp.write_text(json.dumps(listing))
        os.replace(tmp, folder / CHECKSUMS)
        self.checksum_s.append(time.perf_counter() - t0)

    def _save_error(self, step: int | None, exc: BaseException) -> CheckpointSaveError:
        cause = exc
        while cause.__cause__ is not None or cause.__context__ is not None:  # the OSError under orbax's wrappers
            if isinstance(cause, OSError):
                break
            cause = cause.__cause__ or cause.__context__
        text = str(exc)
        code = re.search(r"os_error_code='?(\d+)", text)  # tensorstore's wording of an OSError
        failed = re.search(r'Failed writing: "([^"]+)"', text)
        if isinstance(cause, OSError) and cause.strerror:
            reason = f"{cause.strerror} ({cause.filename})"
        elif code:
            reason = f"{os.strerror(int(code.group(1)))}" + (f" writing {failed.group(1)}" if failed else "")
        else:
            reason = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
        good = self.all_steps()
        what = f"step {step}" if step is not None else "a checkpoint"
        keep = (f"checkpoints {', '.join(map(str, good))} are intact; fix it and run the same command to resume from "
                f"step {good[-1]}") if good else "no earlier checkpoint exists"
        return CheckpointSaveError(f"saving {what} to {self.directory} failed: {reason}; {keep}",
                                   cause=f"{type(exc).__name__}: {text}")

    def wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            step, self._saving = self._saving, None
            raise self._save_error(step, exc) from None

    def close(self) -> None:
        self.wait()
        self._manager.close()

    # ------------------------------------------------------------------------------- reading
    def verify(self, step: int) -> str | None:
        """None if `step`'s files match the checksums written at save time, else what failed."""
        return verify_tree(self.directory / str(step))

    def has_checksums(self, step: int) -> bool:
        return (self.directory / str(step) / CHECKSUMS).exists()

    def set_aside(self, step: int) -> Path:
        """Move a damaged step out of the checkpoint folder (process 0 renames; every process then
        re-reads the list of steps). Returns where it went."""
        folder = self.directory.parent / f"{self.directory.name}_{SET_ASIDE}"
        dest = folder / str(step)
        n = 1
        while dest.exists():
            dest, n = folder / f"{step}.{n}", n + 1
        if jax.process_index() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(self.directory / str(step), dest)
        _barrier(f"set_aside_{step}")
        self._manager.reload()
        return dest

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore onto the shardings carried by `target` (arrays or ShapeDtypeStructs). Raises
        DamagedCheckpoint when the step's bytes disagree with its checksums or orbax cannot read them."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        t0 = time.perf_counter()
        problem = self.verify(step)
        self.verify_s = time.perf_counter() - t0
        if problem is not None and self.has_checksums(step):
            raise DamagedCheckpoint(problem)
        abstract = jax.tree.map(
            lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else abstract_like(x), target)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), loader=ocp.args.JsonRestore()))
        except Exception as exc:  # noqa: BLE001 - unverified (older) checkpoints: orbax's own failure
            raise DamagedCheckpoint(f"orbax could not read it ({type(exc).__name__}: "
                                    f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''})") from None
        return restored["state"], dict(restored["loader"] or {}), step

    def restore_good(self, target: Any, step: int | None = None, log=None) -> tuple[Any, dict, int]:
        """Restore `step`, or the newest step that reads back intact: each damaged newer step is set aside
        with one warning line (its step and what failed). None readable: one UserError line."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        if step is not None:
            if step not in self.all_steps():
                raise UserError(f"trainer.resume_step={step}: no such checkpoint in {self.directory} "
                                f"(have: {', '.join(map(str, self.all_steps())) or 'none'})")
            try:
                return self.restore(target, step)
            except DamagedCheckpoint as exc:
                raise UserError(f"checkpoint step {step} in {self.directory} is damaged: {exc}; pick another "
                                f"trainer.resume_step or drop it to take the newest good one") from None
        set_aside = []
        for candidate in sorted(self.all_steps(), reverse=True):
            if not self.has_checksums(candidate):
                log(f"warning: checkpoint step {candidate} has no {CHECKSUMS} (saved by an older omnijax or cut short "
                    f"after its commit): restoring it unchecked")
            try:
                return self.restore(target, candidate)
            except DamagedCheckpoint as exc:
                dest = self.set_aside(candidate)
                set_aside.append(candidate)
                left = self.all_steps()
                log(f"warning: checkpoint step {candidate} is damaged ({exc}); set aside as {dest}; "
                    + (f"trying step {left[-1]}" if left else "no older checkpoint"))
        raise UserError(f"no readable checkpoint in {self.directory}: steps {', '.join(map(str, set_aside))} are "
                        f"damaged (set aside in {self.directory}_{SET_ASIDE}); start again with a new "
                        f"trainer.run_name or restore a copy")

    def placement_state(self, step: int) -> dict:
        """The placement's state saved with `step` ({} for checkpoints saved without one)."""
        if not (self.directory / str(step) / "placement").exists():
            return {}
        restored = self._manager.restore(step, args=ocp.args.Composite(placement=ocp.args.JsonRestore()))
        return dict(restored["placement"] or {})


_BARRIER_IDS = iter(range(1 << 62))


def _barrier(name: str) -> None:
    """Wait for every process (no-op in one process)."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"omnijax_ck_{name}_{next(_BARRIER_IDS)}", 600_000)
