"""Start a run from what exists: pretrained Hugging Face folders for some parts, or another run's parameters.

LLaVA-style training runs in stages: stage 1 starts the LLM and the encoders from pretrained folders
(`init.llm`, `init.encoders.NAME`), stage 2 from stage 1's latest checkpoint (`init.checkpoint`). Only the
parameters carry over: the optimizer and the data start fresh. Every part is read straight into the
sharding the trainer gave it (the interop readers read only the slices this host's devices hold; the
checkpoint restore reads onto the target's shardings), so no host holds the whole model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from omnijax.errors import UserError
from omnijax.train.checkpoint import abstract_like

CHECKPOINTS = "checkpoints"


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else abstract_like(x), tree)


def load_pretrained(params: Any, llm: str = "", encoders: dict[str, str] | None = None) -> Any:
    """`params` (the model's Param state, arrays in their shardings) with the LLM and the named encoders
    replaced by the weights of their Hugging Face folders, each in the sharding of the array it replaces."""
    from omnijax.interop import pretrained

    if llm:
        if "llm" not in params:
            raise UserError("init.llm: this model has no `llm` part")
        params["llm"] = pretrained.load_llm_params(llm, _abstract(params["llm"]))
    for name, path in (encoders or {}).items():
        if "encoders" not in params or name not in params["encoders"]:
            have = ", ".join(params["encoders"]) if "encoders" in params else "none"
            raise UserError(f"init.encoders.{name}: the model has no encoder {name!r} (its encoders: {have})")
        params["encoders"][name] = pretrained.load_encoder_params(path, _abstract(params["encoders"][name]))
    return params


def run_config(run_dir: str | Path) -> dict:
    """The config a run was started with (`RUN_DIR/config.json`, written by the trainer)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: no config.json (not a run folder; runs are under runs/<trainer.run_name>)")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def latest_step(run_dir: str | Path, key: str = "init.checkpoint") -> int:
    """The newest checkpoint step of a run whose files match their checksums (a damaged newer one is skipped
    with one line); a run without one is a one-line error."""
    import orbax.checkpoint as ocp

    from omnijax.train.checkpoint import newest_good_step

    folder = Path(run_dir) / CHECKPOINTS
    steps = ocp.CheckpointManager(folder.absolute()).all_steps() if folder.is_dir() else []
    if not steps:
        raise UserError(f"{key}={run_dir}: the run has no checkpoint in {folder} (it saved none: train it with "
                        "trainer.checkpoint_every > 0, or let it finish)")
    return newest_good_step(folder.absolute(), [int(s) for s in steps], f"{key}={run_dir}")  # checksums checked


def params_from_run(run_dir: str | Path, params: Any, key: str = "init.checkpoint") -> tuple[Any, int]:
    """The parameters of a run's latest checkpoint, restored onto the shapes and shardings of `params`
    (arrays or ShapeDtypeStructs); its optimizer state and data position are not read."""
    import orbax.checkpoint as ocp

    step = latest_step(run_dir, key)
    target = _abstract(params)
    args = ocp.args.PyTreeRestore(item={"params": target}, partial_restore=True,
                                  restore_args=jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding),
                                                            {"params": target}))
    manager = ocp.CheckpointManager((Path(run_dir) / CHECKPOINTS).absolute())
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=args))
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{key}={run_dir}: its checkpoint {step} does not hold this model's parameters "
                        f"({str(exc).splitlines()[0][:160]})") from None
    finally:
        manager.close()
    return restored["state"]["params"], step


def origins(run_dir: str | Path) -> dict:
    """Where a run's parts came from, following `init.checkpoint` back to the first stage:
    {"llm": HF folder or None, "encoders": {name: HF folder}, "tokenizer": folder or ""}."""
    seen: list[Path] = []
    run = Path(run_dir)
    cfg = run_config(run)
    tokenizer = (cfg.get("tokenizer") or {}).get("path", "")
    while True:
        init = cfg.get("init") or {}
        if not init.get("checkpoint"):
            return {"llm": init.get("llm") or None, "encoders": dict(init.get("encoders") or {}),
                    "tokenizer": tokenizer}
        seen.append(run.resolve())
        run = Path(init["checkpoint"])
        if run.resolve() in seen:
            raise UserError(f"{run_dir}: init.checkpoint runs form a cycle through {run}")
        cfg = run_config(run)
