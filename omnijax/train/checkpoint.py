"""Checkpoints with orbax: async saves, retention, atomic finalisation, checksums, restore onto any mesh.

A checkpoint holds the TrainState, the loader's (small, JSON) state and, for placements that plan
their own buffers (the multiplexer's encoder capacities), the placement's state: a resumed run then
places every step as the uninterrupted run did. orbax writes each step
to a temporary directory and renames it when complete, so an interrupted save never becomes the
latest. Restoring takes an abstract target whose leaves carry the *new* shardings, so a job can
be resized by stop-and-restore.

Checksums: bytes that change after a save (a truncated file, a disk that flips bits, a copy cut
short) must never be loaded silently. Once a step is committed, each process hashes the files it wrote
(orbax names them: `ocdbt.process_<i>/`, `array_metadatas/process_<i>`; the rest is process 0's) in a
background thread, off the training step and off orbax's commit barrier, and writes its part
`omnijax_checksums.part<i>of<n>.json`; the process that finds every part present merges them into
`omnijax_checksums.json` (size and SHA-256 of every file). A step with some parts missing (a run killed
while hashing) counts as saved without checksums, never as checked. `verify(step)` checks them before any value is read; `set_aside(step)` moves a damaged
step out of the way (renamed, never deleted) so the run can resume from an older one.

Only damage sets a step aside: bytes that disagree with their checksums, or (for steps saved without
checksums) bytes orbax cannot decode. A checkpoint of another model (a changed `model.*`, `trainer.trainable`,
optimizer) is told apart before any value is read, from orbax's metadata against the restore target: one
line naming the first differing parameters and the config keys that changed (the run's `config.json`
against this one), nothing moved (CheckpointMismatch). A read that fails with an OS error is retried
(`READ_RETRY_S`), then stops in one line naming the file, nothing moved (CheckpointReadError).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from omnijax.errors import UserError

CHECKSUMS = "omnijax_checksums.json"
SET_ASIDE = "set_aside"          # run_dir/checkpoints/../checkpoints_set_aside/<step>[.n]
_TMP = ".orbax-checkpoint-tmp"
# orbax rewrites these after the commit (timestamps, a commit marker): not covered by the checksums
_MUTABLE = {CHECKSUMS, "_CHECKPOINT_METADATA", "commit_success.txt"}
_PART = re.compile(r"omnijax_checksums\.part(\d+)of(\d+)\.json")
_MERGING = "omnijax_checksums.merging"   # created exclusively by the one process that merges the parts
_WRITER = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")
COMMIT_WAIT_S = 600.0   # how long a hashing thread waits for its step's commit before giving up (no part)


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

    def __init__(self, message: str, cause: str = "", cause_error: BaseException | None = None):
        super().__init__(message)
        self.cause, self.cause_error = cause, cause_error


class DamagedCheckpoint(Exception):
    """A step whose files disagree with its checksums (or, saved without checksums, cannot be decoded)."""


class CheckpointRestoreError(UserError):
    """A restore that failed for another reason than damage, a mismatch or an OS error (e.g. a peer lost
    mid-restore); `cause` keeps the underlying error for the lost-peer verdict."""

    def __init__(self, message: str, cause: str = "", cause_error: BaseException | None = None):
        super().__init__(message)
        self.cause, self.cause_error = cause, cause_error


class CheckpointMismatch(UserError):
    """The checkpoint holds another model than the configured one (parameters, shapes or dtypes differ).
    `differences` are lines `path: saved -> configured`, first differing parameters first."""

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = differences or []


class CheckpointReadError(UserError):
    """Reading a checkpoint failed with an OS error after every retry (a flaky mount, a lost disk)."""


READ_RETRY_S = (1.0, 4.0)  # waits before the 2nd and 3rd attempt of a read that failed with an OS error
_sleep = time.sleep         # (tests replace it: the retries' waits without the wall time)
# config keys whose change cannot change what a checkpoint holds (left out of the mismatch line)
_RUN_ONLY_KEYS = ("trainer.steps", "trainer.run_name", "trainer.resume_step", "trainer.progress", "trainer.log_every",
                  "trainer.eval_every", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                  "trainer.hang_timeout_s", "trainer.peer_timeout_s", "parallel.cpu_devices", "parallel.cpu_threads")


class _ReadFailed(Exception):
    """An OS error reading `path` (raised inside one attempt; retried by `_retrying`)."""

    def __init__(self, path: Any, error: BaseException):
        super().__init__(f"{path}: {error}")
        self.path, self.error = path, error


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with each leaf's current sharding: the restore target for this layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _os_error(exc: BaseException) -> tuple[str, str] | None:
    """(file, reason) when `exc` is an OS error reading a file (directly, under orbax's wrappers, or in
    tensorstore's status, which carries the OS error code), else None."""
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, _ReadFailed):
            return str(cause.path), cause.error.strerror or str(cause.error)
        if isinstance(cause, OSError) and not isinstance(cause, (FileNotFoundError, NotADirectoryError)):
            return str(cause.filename or "?"), cause.strerror or str(cause)
        cause = cause.__cause__ or cause.__context__
    text = str(exc)
    code = re.search(r"os_error_code='?(\d+)", text)  # tensorstore's status for an OSError
    if code:
        where = re.search(r'(?:reading|Error opening|Failed reading)[^"]*"([^"]+)"', text)
        return (where.group(1) if where else "?"), os.strerror(int(code.group(1)))
    return None


def _retrying(what: str, read: Callable[[], Any], log: Callable[[str], None] | None = None) -> Any:
    """`read()`, again after each wait of READ_RETRY_S when it fails with an OS error; the last failure is
    one CheckpointReadError line naming the file (nothing is moved: the bytes may well be intact)."""
    for attempt in range(len(READ_RETRY_S) + 1):
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - only OS errors are retried; the rest propagate
            failed = _os_error(exc)
            if failed is None:
                raise
            if attempt == len(READ_RETRY_S):
                raise CheckpointReadError(
                    f"reading {what} failed {attempt + 1} times with an OS error: {failed[1]} ({failed[0]}); "
                    "nothing was moved; check the disk or mount and run the same command again") from None
            if log is not None:
                log(f"warning: reading {what}: {failed[1]} ({failed[0]}); retrying in {READ_RETRY_S[attempt]:g} s")
            _sleep(READ_RETRY_S[attempt])
    raise AssertionError("unreachable")


def writer_of(rel: str) -> int:
    """The process that wrote `rel` (a path inside a step): orbax names per-process files by process index;
    everything else (the merged ocdbt root, _METADATA, _sharding, JSON items) is written by process 0."""
    m = _WRITER.search(rel)
    return int(m.group(1)) if m else 0


def checksum_tree(folder: Path, process: int | None = None) -> dict:
    """{relative path: [bytes, sha256]} of every file under `folder` (but orbax's own step metadata and our
    listings); with `process`, only the files that process wrote."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            p = Path(root) / name
            rel = p.relative_to(folder).as_posix()
            if rel in _MUTABLE or rel.startswith("omnijax_checksums"):  # listings, parts, their temporaries
                continue
            if process is None or writer_of(rel) == process:
                out[rel] = [p.stat().st_size, _sha256(p)]
    return out


def merge_into_listing(folder: Path) -> bool:
    """Write CHECKSUMS from the parts once every process's part is there, by exactly one process (the first to
    create the merging marker after seeing them all; the last part written always sees them all)."""
    if (folder / CHECKSUMS).exists() or not has_listing(folder):
        return False
    try:
        fd = os.open(folder / _MERGING, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    try:
        listing = None if (folder / CHECKSUMS).exists() else merge_parts(folder)  # merged by another meanwhile
        if listing is None:  # or parts that disagree: left as they are
            return False
        _write_json(folder / CHECKSUMS, listing)
        for part in _parts(folder)[0].values():
            part.unlink(missing_ok=True)
        return True
    finally:
        (folder / _MERGING).unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _parts(folder: Path) -> tuple[dict[int, Path], int | None]:
    """The checksum parts in `folder` by process, and how many processes saved the step (None: no parts)."""
    found, counts = {}, set()
    for p in folder.glob("omnijax_checksums.part*of*.json"):
        m = _PART.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
            counts.add(int(m.group(2)))
    return found, (counts.pop() if len(counts) == 1 else None) if counts else None


def merge_parts(folder: Path) -> dict | None:
    """The listing made of every process's part, or None while a part is missing (or they disagree)."""
    found, n = _parts(folder)
    if n is None or sorted(found) != list(range(n)):
        return None
    files: dict = {}
    hashed_by: dict = {}
    for i in range(n):
        part = json.loads(found[i].read_text())
        if part.get("process") != i or set(part["files"]) & set(files):
            return None  # a part in the wrong place, or a file claimed twice: not a trustworthy listing
        files.update(part["files"])
        hashed_by[str(i)] = sorted(part["files"])
    return {"format": 1, "files": files, "hashed_by": hashed_by}


def _read_listing(folder: Path) -> dict | None:
    listing = folder / CHECKSUMS
    if listing.exists():
        return json.loads(listing.read_text())
    try:
        return merge_parts(folder)  # killed between the last part and the merge
    except FileNotFoundError:       # merged meanwhile
        return json.loads(listing.read_text()) if listing.exists() else None


def has_listing(folder: Path) -> bool:
    """A merged checksum file, or a part from every process that saved the step."""
    if (folder / CHECKSUMS).exists():
        return True
    found, n = _parts(folder)
    return n is not None and sorted(found) == list(range(n))


def verify_tree(folder: Path) -> str | None:
    """None if every file listed in FOLDER/omnijax_checksums.json (or in every process's part of it) has its
    size and hash; else what failed. Missing parts make the step unchecked, never good."""
    try:
        data = _read_listing(folder)
    except (ValueError, KeyError, TypeError):
        return f"{CHECKSUMS} is unreadable"
    if data is None:
        found, n = _parts(folder)
        if found:
            return (f"no checksum file and only the parts of processes {sorted(found)} of {n} "
                    "(cut short while hashing)")
        return "no checksum file (saved by an older omnijax, or cut short)"
    try:
        files = data["files"]
    except (KeyError, TypeError):
        return f"{CHECKSUMS} is unreadable"
    for rel, entry in sorted(files.items()):
        size, digest = entry[0], entry[1]
        p = folder / rel
        if not p.exists():
            return f"{rel} is missing"
        have = p.stat().st_size
        if have != size:
            return f"{rel} has {have} bytes, {size} were written"
        try:
            ok = _sha256(p) == digest
        except OSError as exc:  # the bytes could not be read: not known to be damaged (retried by the caller)
            raise _ReadFailed(p, exc) from None
        if not ok:
            return f"{rel} has the right size but different bytes (checksum mismatch)"
    return None


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tree_layout(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{orbax's parameter name (`params.blocks.0.attn.q.value`): (shape, dtype)} of every array leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]  # (orbax's ArrayMetadata are leaves; nnx Variables not)
    return {".".join(_key_name(k) for k in path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flat
            if hasattr(leaf, "shape")}


def layout_differences(saved: dict, configured: dict) -> list[str]:
    """Lines `name: saved -> configured` for the entries whose presence, shape or dtype differ, the model's
    parameters before the optimizer state."""
    out = []
    for name in sorted(set(saved) | set(configured), key=lambda n: (not n.startswith("params."), n)):
        a, b = saved.get(name), configured.get(name)
        if a == b:
            continue
        show = lambda v: "absent" if v is None else f"{list(v[0])} {v[1]}"  # noqa: E731
        out.append(f"{name}: saved {show(a)} -> configured {show(b)}")
    return out


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict, current: dict) -> list[str]:
    """`key: saved -> now` for the settings that differ and can change what a checkpoint holds (model,
    trainable parts, optimizer, layout), model keys first."""
    a, b = _flat(saved), _flat(current)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(_RUN_ONLY_KEYS)]
    keys.sort(key=lambda k: (not k.startswith("model."), not k.startswith(("trainer.trainable", "optimizer.")), k))
    return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in keys]


_SERIAL_REPLICAS_SET = False


def _serial_replicas_on_cpu() -> None:
    """On the CPU backend, save each replicated array from its first replica (orbax's default on GPU) instead of
    orbax's replica-parallel default, which has each replica write a slice: every slice is a jitted program,
    compiled per device and shape (86 compiles for a 9-array state saved twice on 8 CPU devices, ~1.6 CPU-s; a
    LoRA run compiled 128). The CPU devices share one host's memory and disk, so the slices save no time there.
    The files hold the same values (restore reads either way); elsewhere orbax's default is kept."""
    global _SERIAL_REPLICAS_SET
    if _SERIAL_REPLICAS_SET or jax.default_backend() != "cpu":
        return
    current = ocp.type_handlers.get_type_handler(jax.Array)
    # only orbax's own handler (another one registered by the caller is left alone); orbax has no public
    # setter: its constructor option, on a copy that keeps the registered handler's metadata store
    if type(current) is ocp.type_handlers.ArrayHandler and getattr(current, "_use_replica_parallel", False):
        serial = copy.copy(current)
        serial._use_replica_parallel = False
        ocp.type_handlers.register_type_handler(jax.Array, serial, override=True)
    _SERIAL_REPLICAS_SET = True


class Checkpointer:
    def __init__(self, directory: Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.async_save = async_save
        self._saving: int | None = None      # the step an async save is writing
        self.checksum_s: list[float] = []     # seconds this process spent hashing its files of each save
        self.hash_wait_s: list[float] = []    # seconds a save (or close) waited for the previous step's hashing
        self.verify_s = 0.0                   # seconds spent checking the restored step's checksums
        self._hashing: threading.Thread | None = None
        self._hash_error: BaseException | None = None
        self._abandon = threading.Event()     # set when the save being hashed failed: its folder never appears
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True,
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
        _serial_replicas_on_cpu()
        self._saving = step
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        except Exception as exc:  # noqa: BLE001 - orbax wraps OSErrors in several types
            raise self._save_error(step, exc) from None
        if saved:
            self._abandon.clear()
            self._hashing = threading.Thread(target=self._hash_own, args=(step, jax.process_index(),
                                             jax.process_count()), name=f"omnijax-hash-{step}", daemon=True)
            self._hashing.start()
        return saved

    def _hash_own(self, step: int, process: int, count: int) -> None:
        """Background thread, every process: once `step` is committed (orbax renamed its folder into place),
        hash the files this process wrote, write its part, and merge the parts if they are all there."""
        try:
            folder = self.directory / str(step)
            deadline = time.monotonic() + COMMIT_WAIT_S
            while not folder.is_dir() or any(self.directory.glob(f"{step}{_TMP}*")):
                if self._abandon.is_set() or time.monotonic() > deadline:
                    return  # the save failed or never committed: no part, so never counted as checked
                time.sleep(0.02)
            t0 = time.perf_counter()
            files = checksum_tree(folder, process)
            _write_json(folder / f"omnijax_checksums.part{process}of{count}.json",
                        {"format": 1, "process": process, "processes": count, "files": files})
            self.checksum_s.append(time.perf_counter() - t0)
            merge_into_listing(folder)
        except BaseException as exc:  # noqa: BLE001 - reported by wait(), the step stays unchecked
            self._hash_error = exc

    def _join_hashing(self) -> None:
        if self._hashing is None:
            return
        t0 = time.perf_counter()
        self._hashing.join()
        self.hash_wait_s.append(time.perf_counter() - t0)
        self._hashing = None
        if self._hash_error is not None:
            exc, self._hash_error = self._hash_error, None
            print(f"warning: hashing checkpoint files failed ({type(exc).__name__}: {_first_line(exc)}); "
                  "that step will restore unchecked", file=sys.stderr, flush=True)

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
                                   cause=f"{type(exc).__name__}: {text}", cause_error=exc)

    def wait(self) -> None:
        """Until the running save is committed and this process has hashed its files of it."""
        try:
            self._manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            step, self._saving = self._saving, None
            self._abandon.set()
            self._join_hashing()
            raise self._save_error(step, exc) from None
        self._join_hashing()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    # ------------------------------------------------------------------------------- reading
    def verify(self, step: int, log: Callable[[str], None] | None = None) -> str | None:
        """None if `step`'s files match the checksums written at save time, else what failed. A file that
        cannot be read (an OS error) is retried, then a CheckpointReadError."""
        folder = self.directory / str(step)
        return _retrying(f"checkpoint step {step} in {self.directory}", lambda: verify_tree(folder), log)

    def has_checksums(self, step: int) -> bool:
        return has_listing(self.directory / str(step))

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

    def saved_layout(self, step: int) -> dict[str, tuple[tuple[int, ...], str]] | None:
        """What `step` holds, from orbax's metadata (no values read); None when it records no layout."""
        folder = self.directory / str(step) / "state"
        if not folder.is_dir():
            return None
        meta = ocp.StandardCheckpointHandler().metadata(folder)
        tree = getattr(meta, "tree", meta)
        return tree_layout(tree) if tree else None

    def check_layout(self, target: Any, step: int, log: Callable[[str], None] | None = None) -> None:
        """Raise CheckpointMismatch when `step` holds other parameters, shapes or dtypes than `target`;
        DamagedCheckpoint when its metadata cannot be decoded."""
        try:
            saved = _retrying(f"checkpoint step {step} in {self.directory}", lambda: self.saved_layout(step), log)
        except CheckpointReadError:
            raise
        except Exception as exc:  # noqa: BLE001 - metadata that cannot be decoded
            raise DamagedCheckpoint(f"its metadata cannot be decoded ({_first_line(exc)})") from None
        if saved is None:
            return
        differences = layout_differences(saved, tree_layout(target))
        if differences:
            raise CheckpointMismatch(f"checkpoint step {step} in {self.directory} holds another model than the "
                                     f"configured one", differences)

    def restore(self, target: Any, step: int | None = None, log: Callable[[str], None] | None = None
                ) -> tuple[Any, dict, int]:
        """Restore onto the shardings carried by `target` (arrays or ShapeDtypeStructs). Raises
        DamagedCheckpoint when the step's bytes disagree with its checksums (or, without checksums, cannot be
        decoded), CheckpointMismatch when it holds another model, CheckpointReadError when reading keeps
        failing with an OS error."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        t0 = time.perf_counter()
        problem = self.verify(step, log)
        self.verify_s = time.perf_counter() - t0
        checked = self.has_checksums(step)
        if problem is not None and checked:
            raise DamagedCheckpoint(problem)
        abstract = jax.tree.map(
            lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else abstract_like(x), target)
        self.check_layout(abstract, step, log)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), loader=ocp.args.JsonRestore())
        try:
            restored = _retrying(f"checkpoint step {step} in {self.directory}",
                                 lambda: self._manager.restore(step, args=args), log)
        except CheckpointReadError:
            raise
        except Exception as exc:  # noqa: BLE001
            if not checked:  # saved without checksums: bytes orbax cannot decode are the damage we can see
                raise DamagedCheckpoint(f"orbax could not read it ({type(exc).__name__}: {_first_line(exc)})") from None
            raise CheckpointRestoreError(
                f"restoring checkpoint step {step} from {self.directory} failed although its files match their "
                f"checksums ({type(exc).__name__}: {_first_line(exc)}); nothing was moved",
                cause=f"{type(exc).__name__}: {exc}", cause_error=exc) from exc
        return restored["state"], dict(restored["loader"] or {}), step

    def mismatch_line(self, exc: CheckpointMismatch, config: dict | None) -> str:
        """The one line for a resume whose checkpoint holds another model: the first differing parameters
        and the config keys that changed against the run's own `config.json`."""
        first = exc.differences[:3]
        more = f" (and {len(exc.differences) - 3} more)" if len(exc.differences) > 3 else ""
        changed = ""
        saved_cfg = self.directory.parent / "config.json"
        if config is not None and saved_cfg.is_file():
            try:
                changes = config_changes(json.loads(saved_cfg.read_text()), config)
            except (ValueError, OSError):
                changes = []
            changed = (f"; this command differs from the run's {saved_cfg.name} in " + ", ".join(changes[:4])
                       + (" ..." if len(changes) > 4 else "") if changes else
                       f"; the settings match the run's {saved_cfg.name}: the code that builds the model changed")
        return (f"{exc}: {'; '.join(first)}{more}{changed}. Nothing was moved: run with the run's settings to resume "
                f"from it, or choose a new trainer.run_name to start afresh")

    def restore_good(self, target: Any, step: int | None = None, log=None, config: dict | None = None
                     ) -> tuple[Any, dict, int]:
        """Restore `step`, or the newest step that reads back intact: each damaged newer step is set aside
        with one warning line (its step and what failed). None readable: one UserError line. A checkpoint of
        another model (`config`, this run's settings, names what changed) or a read that keeps failing stops
        in one line and moves nothing."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))

        def attempt(candidate: int):
            try:
                return self.restore(target, candidate, log)
            except CheckpointMismatch as exc:
                raise CheckpointMismatch(self.mismatch_line(exc, config), exc.differences) from None

        if step is not None:
            if step not in self.all_steps():
                raise UserError(f"trainer.resume_step={step}: no such checkpoint in {self.directory} "
                                f"(have: {', '.join(map(str, self.all_steps())) or 'none'})")
            try:
                return attempt(step)
            except DamagedCheckpoint as exc:
                raise UserError(f"checkpoint step {step} in {self.directory} is damaged: {exc}; pick another "
                                f"trainer.resume_step or drop it to take the newest good one") from None
        set_aside = []
        for candidate in sorted(self.all_steps(), reverse=True):
            if not self.has_checksums(candidate):
                log(f"warning: checkpoint step {candidate} has no {CHECKSUMS} (saved by an older omnijax or cut short "
                    f"after its commit): restoring it unchecked")
            try:
                return attempt(candidate)
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


def newest_good_step(folder: Path, steps: list[int], key: str, log: Callable[[str], None] | None = None) -> int:
    """The newest of `steps` (a run's committed checkpoint steps in `folder`) whose files match their
    checksums, for readers of another run (`init.checkpoint`, export, generate): a damaged newer step is
    skipped with one line saying which step is read instead, and left where it is (that run owns it)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    damaged = []
    for step in sorted(steps, reverse=True):
        problem = _retrying(f"{key}: checkpoint step {step} in {folder}", lambda: verify_tree(folder / str(step)), log)
        if problem is None or not has_listing(folder / str(step)):
            if damaged:
                log(f"warning: {key}: checkpoint step{'s' if len(damaged) > 1 else ''} "
                    f"{', '.join(str(d) for d, _ in damaged)} in {folder} "
                    f"{'are' if len(damaged) > 1 else 'is'} damaged ({damaged[0][1]}); reading step {step}, the "
                    f"newest whose checksums hold")
            elif problem is not None:
                log(f"warning: {key}: checkpoint step {step} in {folder} has no {CHECKSUMS} (saved by an older "
                    "omnijax): reading it unchecked")
            return step
        damaged.append((step, problem))
    raise UserError(f"{key}: every checkpoint in {folder} is damaged (step {damaged[0][0]}: {damaged[0][1]}); "
                    "nothing can be read from it" if damaged else f"{key}: no checkpoint in {folder}")


_BARRIER_IDS = iter(range(1 << 62))


def _barrier(name: str) -> None:
    """Wait for every process (no-op in one process)."""
    if jax.process_count() == 1:
        return
    from omnijax.jax_private import distributed

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"omnijax_ck_{name}_{next(_BARRIER_IDS)}", 600_000)
