"""omnijax's LLM train step against MaxText's on the same llama shape, in alternating rounds.

    python -m recipes bench maxtext mt_python=/path/to/mt_venv/bin/python shape=tiny layouts=[1dev,fsdp8,dp8] rounds=3

MaxText is never imported here and is no dependency of omnijax: it runs in its own virtual environment
(``mt_python``, a Python with the ``maxtext`` package; docs/performance.md says how to make one). Each
measurement is a fresh process: omnijax runs ``python -m recipes bench llm_step`` (the command a user types,
so the same code path), MaxText runs ``python -m maxtext.trainers.pre_train.train`` with the matching
overrides of its ``configs/base.yml``. Both run under the same allocator (tcmalloc when installed).

Separate processes on a shared machine are not comparable to 10% (the same step measured minutes apart
differs by that much), so the two trainers alternate: round r times every layout as omnijax then MaxText
(MaxText first in odd rounds), so each pair of processes is adjacent in time, and the figure is the median over
rounds of the per-round ratio ``maxtext_step_s / omnijax_step_s`` (> 1: omnijax is faster) with its min and max.
Each process's step time is the median of its timed steps (omnijax: ``bench.repeats`` rounds of one step;
MaxText: its own per-step log, the first ``warmup`` steps dropped).

Options (``key=value``):
- ``mt_python``: required; the Python of the MaxText environment.
- ``shape``: ``tiny`` (2 layers, d256, 4x64 heads, MLP 1024, vocab 32000, seq 256, fp32, batch 8, no remat),
  ``large`` (module constant LARGE: GQA, seq 1024, bf16 compute with fp32 weights, remat full) or ``mm`` (module
  constant MM: MaxText's Gemma3 multimodal step at a tiny size against omnijax's ``tiny_omni`` of the same sizes,
  one device, on the same 32 image/question/answer rows: ``prepare_mm_data``; needs ``datasets`` in mt_python's
  environment. omnijax's step time is read from its run's ``metrics.jsonl``).
- ``layouts``: any of ``1dev``, ``fsdp8``, ``dp8`` (8 fake CPU devices), e.g. ``layouts=[1dev,fsdp8]``.
- ``rounds`` (3), ``steps`` (timed steps per process; 12 tiny, 3 large, 4 mm), ``warmup`` (MaxText steps dropped from
  its log, 4: its log lags a step behind and its first steps include dispatch of the compiled program),
  ``oj_warmup`` (omnijax steps run before timing, after its ahead-of-time compile: 2 tiny, 1 large;
  for mm, the training steps dropped from its metrics, 2).
- ``remat``: ``none`` or ``full`` for both trainers (default: the shape's).
- ``profile=DIR``: round 0 also dumps both compiled programs under DIR (``--xla_dump_to``) and every row gets
  the op counts of each train step (``hlo_summary``).
- ``oj.KEY=VALUE`` / ``mt.KEY=VALUE``: extra overrides passed to one side only (named in the row).
- ``timeout_s`` (3600): per process.

One JSON row per layout: both step times per round, the per-round ratios, their median/min/max, the load
average at the start of each process and the allocator, printed after the last round; stderr gets every
process's step time and every pair's ratio (with the running median) as they complete, so a run stopped early keeps
its figures. The machine's other load falls on both trainers alike only on average: read the spread before the
median.
"""
from __future__ import annotations

import glob
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from omnijax import allocator
from omnijax.errors import UserError
from omnijax.perfmodel.step_model import parse_hlo
from omnijax.train.metrics import read_metrics

DESCRIPTION = ("omnijax's LLM train step vs MaxText's (its own venv, mt_python=...) on the same llama shape, "
               "alternating rounds: median ratio with its spread, per layout (1dev, fsdp8, dp8)")

ROOT = Path(__file__).resolve().parents[2]  # the checkout the child omnijax runs from

# vocab, d_model, layers, query heads, kv heads, head dim, MLP, seq, global batch, compute dtype, remat
TINY = dict(vocab=32000, d=256, layers=2, heads=4, kv_heads=4, head_dim=64, mlp=1024, seq=256, batch=8,
            dtype="float32", remat="none")
# the largest llama-architecture shape whose step stayed near 20 s on the loaded 2-core machine this was written on
# (omnijax, one device: 22.6 s; with Llama 2's 32000-token vocabulary the [8192 x 32000] logits alone made it 56 s, and
# d512 x 8 heads x MLP 1536 60 s): GQA, seq 1024, bf16 compute over fp32 weights, every layer recomputed
LARGE = dict(vocab=8192, d=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=1024, seq=1024, batch=8,
             dtype="bfloat16", remat="full")
# MaxText's Gemma3 multimodal step at a tiny size (its gemma3-4b config with override_model_config): every image
# resized to 896x896 by Gemma3's preprocessing, 4096 patches of 14x14 through a 1-layer ViT 128 wide, pooled 4x4 to
# 256 LLM tokens; 2 LLM layers with Gemma3's 262144-token tied vocabulary; one row per sample (packing is refused
# for multimodal SFT), loss on the answers only. `images` rows of noise with a question and an answer each.
MM = dict(vocab=262144, d=256, layers=2, heads=4, kv_heads=2, head_dim=64, mlp=1024, seq=512, batch=2,
          vit_d=128, vit_mlp=512, vit_layers=1, vit_heads=2, image=896, patch=14, pool=4, images=32,
          dtype="float32", remat="none")
SHAPES = {"tiny": TINY, "large": LARGE, "mm": MM}
LAYOUTS = ("1dev", "fsdp8", "dp8")


def _parse_list(value: str) -> list[str]:
    value = value.strip()
    if value.startswith("["):
        value = value[1:-1]
    return [v.strip().strip("'\"") for v in value.split(",") if v.strip()]


def parse_options(overrides: list[str]) -> dict:
    opts: dict = {"shape": "tiny", "layouts": list(LAYOUTS), "rounds": 3, "warmup": 4, "steps": None, "oj_warmup": None,
                  "remat": None, "profile": "", "timeout_s": 3600, "oj": [], "mt": [], "mt_python": ""}
    for item in overrides:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise UserError(f"bench maxtext: {item!r} is not key=value")
        if key.startswith("oj.") or key.startswith("mt."):
            opts[key[:2]].append(f"{key[3:]}={value}")
        elif key == "layouts":
            opts["layouts"] = _parse_list(value)
        elif key in ("rounds", "warmup", "steps", "timeout_s", "oj_warmup"):
            opts[key] = int(value)
        elif key in ("shape", "remat", "profile", "mt_python"):
            opts[key] = value.strip()
        else:
            raise UserError(f"bench maxtext: unknown option {key!r} (mt_python, shape, layouts, rounds, steps, "
                            "warmup, oj_warmup, remat, profile, timeout_s, oj.KEY, mt.KEY)")
    if opts["shape"] not in SHAPES:
        raise UserError(f"bench maxtext: shape={opts['shape']!r}: use one of {', '.join(SHAPES)}")
    if opts["shape"] == "mm":
        explicit = any(o.strip().startswith("layouts=") for o in overrides)
        if explicit and opts["layouts"] != ["1dev"]:
            raise UserError("bench maxtext: shape=mm compares one device only (layouts=[1dev])")
        opts["layouts"] = ["1dev"]
        if opts["remat"] not in (None, "none"):
            raise UserError("bench maxtext: shape=mm runs remat=none")
    bad = [x for x in opts["layouts"] if x not in LAYOUTS]
    if bad or not opts["layouts"]:
        raise UserError(f"bench maxtext: layouts={opts['layouts']}: each one of {', '.join(LAYOUTS)}")
    if opts["remat"] not in (None, "none", "full"):
        raise UserError(f"bench maxtext: remat={opts['remat']!r}: none or full")
    if opts["rounds"] < 1:
        raise UserError("bench maxtext: rounds must be >= 1")
    if opts["steps"] is None:
        opts["steps"] = {"tiny": 12, "large": 3, "mm": 4}[opts["shape"]]
    if opts["oj_warmup"] is None:
        opts["oj_warmup"] = 2 if opts["shape"] in ("tiny", "mm") else 1
    return opts


def maxtext_base_yml(mt_python: str) -> str:
    """The path of MaxText's configs/base.yml under ``mt_python``, or a UserError saying what is wrong."""
    if not mt_python:
        raise UserError("bench maxtext needs mt_python=/path/to/venv/bin/python, a Python with maxtext installed "
                        "(docs/performance.md: how to make that environment; it stays outside omnijax's)")
    if not (os.path.isfile(mt_python) and os.access(mt_python, os.X_OK)):
        raise UserError(f"bench maxtext: mt_python={mt_python}: no such executable")
    probe = subprocess.run([mt_python, "-c", "import maxtext, os; print(os.path.join(os.path.dirname("
                            "maxtext.__file__), 'configs', 'base.yml'))"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"bench maxtext: mt_python={mt_python} cannot import maxtext ({last}); install it there "
                        "as docs/performance.md says")
    path = probe.stdout.strip().splitlines()[-1]
    if not os.path.isfile(path):
        raise UserError(f"bench maxtext: {path} (MaxText's base config) not found under mt_python={mt_python}")
    return path


def omnijax_overrides(shape: dict, layout: str, remat: str, steps: int, warmup: int) -> list[str]:
    s = shape
    args = [f"model.vocab_size={s['vocab']}", f"model.embed_dim={s['d']}", f"model.num_layers={s['layers']}",
            f"model.num_heads={s['heads']}", f"model.num_kv_heads={s['kv_heads']}", f"model.head_dim={s['head_dim']}",
            f"model.mlp_dim={s['mlp']}", "model.tie_embeddings=false", f"model.max_seq_len={s['seq']}",
            f"data.seq_len={s['seq']}", f"data.batch_size={s['batch']}", f"trainer.compute_dtype={s['dtype']}",
            f"parallel.remat={remat}", f"bench.warmup={warmup}", f"bench.repeats={steps}", "bench.steps=1"]
    if layout != "1dev":
        args += ["parallel.cpu_devices=8", f"parallel.llm={layout}", "bench.only=parallel"]
    return args


def maxtext_overrides(shape: dict, layout: str, remat: str, steps: int, warmup: int) -> list[str]:
    s = shape
    args = ["hardware=cpu", "skip_jax_distributed_system=True", "enable_checkpointing=False",
            "dataset_type=synthetic", "packing=False", "decoder_block=llama2", "attention=dot_product",
            f"max_target_length={s['seq']}", f"base_num_decoder_layers={s['layers']}", f"base_emb_dim={s['d']}",
            f"base_num_query_heads={s['heads']}", f"base_num_kv_heads={s['kv_heads']}", f"head_dim={s['head_dim']}",
            f"base_mlp_dim={s['mlp']}", f"vocab_size={s['vocab']}", f"dtype={s['dtype']}", "weight_dtype=float32",
            "enable_dropout=False", f"steps={warmup + steps}", "jax_cache_dir=", "log_period=1000000"]
    args += ["remat_policy=full"] if remat == "full" else ["remat_policy=none", "scan_layers=False"]
    if layout == "1dev":
        args += [f"per_device_batch_size={s['batch']}"]
    else:
        per = s["batch"] // 8
        if per * 8 != s["batch"]:
            raise UserError(f"bench maxtext: global batch {s['batch']} does not split over 8 devices")
        axis = "ici_fsdp_parallelism" if layout == "fsdp8" else "ici_data_parallelism"
        other = "ici_data_parallelism" if layout == "fsdp8" else "ici_fsdp_parallelism"
        args += [f"per_device_batch_size={per}", f"{axis}=8", f"{other}=1"]
    return args


def omnijax_mm_overrides(shape: dict, data: dict, steps: int, warmup: int) -> list[str]:
    """`python -m recipes tiny_omni` on the converted rows, sized as MaxText's tiny Gemma3: a learned-position ViT
    over the 896x896 images, a 4x4 merger to the same 256 tokens per image, the tokenizer's vocabulary plus
    omnijax's three placeholder ids (rounded up to 64), tied embeddings, one sample per row of `seq`."""
    s = shape
    grid = s["image"] // s["patch"]
    v = "model.encoders.vision."
    return [f"data.sources=[{data['shards']}]", f"tokenizer.path={data['tokenizer']}",
            f"model.llm.vocab_size={s['vocab'] + 64}", f"model.llm.embed_dim={s['d']}",
            f"model.llm.num_layers={s['layers']}", f"model.llm.num_heads={s['heads']}",
            f"model.llm.num_kv_heads={s['kv_heads']}", f"model.llm.head_dim={s['head_dim']}",
            f"model.llm.mlp_dim={s['mlp']}", f"model.llm.max_seq_len={s['seq']}", "model.llm.tie_embeddings=true",
            f"{v}patch={s['patch']}", f"{v}image_size={s['image']}", f"{v}max_side={s['image']}",
            f"{v}merge={s['pool']}", f"{v}temporal_patch=1", f"{v}embed_dim={s['vit_d']}",
            f"{v}num_layers={s['vit_layers']}", f"{v}num_heads={s['vit_heads']}", f"{v}mlp_dim={s['vit_mlp']}",
            f"{v}position=learned", f"{v}learned_grid={grid}", f"{v}abs_position=false",
            f"data.seq_len={s['seq']}", f"data.batch_size={s['batch']}", f"capacity.vision={s['batch'] * grid * grid}",
            "capacity.audio=auto", f"trainer.compute_dtype={s['dtype']}", "parallel.remat=none",
            "trainer.checkpoint_every=0", "trainer.eval_every=0", "trainer.log_every=1", "trainer.progress=false",
            f"trainer.steps={warmup + steps}"]


def maxtext_mm_overrides(shape: dict, data: dict, steps: int, warmup: int) -> list[str]:
    """MaxText's multimodal SFT path on the same rows (its synthetic data has no images): a parquet file through its
    Hugging Face pipeline, which asks for completion-only loss and no packing when multimodal."""
    s = shape
    return ["model_name=gemma3-4b", "override_model_config=True", "hardware=cpu", "skip_jax_distributed_system=True",
            "enable_checkpointing=False", "attention=dot_product", f"base_num_decoder_layers={s['layers']}",
            f"base_emb_dim={s['d']}", f"base_num_query_heads={s['heads']}", f"base_num_kv_heads={s['kv_heads']}",
            f"head_dim={s['head_dim']}", f"base_mlp_dim={s['mlp']}", f"hidden_size_for_vit={s['vit_d']}",
            f"intermediate_size_for_vit={s['vit_mlp']}", f"num_hidden_layers_for_vit={s['vit_layers']}",
            f"num_attention_heads_for_vit={s['vit_heads']}", "use_multimodal=True", "use_sft=True",
            "sft_train_on_completion_only=True", "packing=False", "dataset_type=hf", "hf_path=parquet",
            f"hf_train_files={data['parquet']}", "train_data_columns=['question','answer']", "train_image_column=image",
            "tokenizer_type=huggingface", f"tokenizer_path={data['tokenizer']}", f"max_target_length={s['seq']}",
            f"per_device_batch_size={s['batch']}", f"steps={warmup + steps}", f"dtype={s['dtype']}",
            "weight_dtype=float32", "enable_dropout=False", "remat_policy=none", "scan_layers=False", "jax_cache_dir=",
            "log_period=1000000"]


# Run with mt_python: MaxText's Gemma3 tokenizer as a Hugging Face tokenizer.json folder (both trainers read it), and
# the rows as a parquet file with the image bytes inside (MaxText's `datasets` pipeline reads it).
_MM_MT_PREP = """
import json, os, sys
import maxtext
out = sys.argv[1]
rows = json.load(open(os.path.join(out, "rows.json")))
try:
    import datasets, transformers
except ImportError as exc:
    sys.exit(f"missing in the MaxText environment: {exc.name} (pip install datasets transformers there)")
src = os.path.join(out, "tokenizer_src")
os.makedirs(src, exist_ok=True)
model = os.path.join(os.path.dirname(maxtext.__file__), "assets", "tokenizers", "tokenizer.gemma3")
if not os.path.exists(os.path.join(src, "tokenizer.model")):
    os.symlink(model, os.path.join(src, "tokenizer.model"))
transformers.GemmaTokenizer.from_pretrained(src).save_pretrained(os.path.join(out, "tokenizer"))
feats = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                           "answer": datasets.Value("string")})
ds = datasets.Dataset.from_dict({"image": [{"bytes": open(os.path.join(out, r["image"]), "rb").read(), "path": None}
                                           for r in rows],
                                 "question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]},
                                features=feats)
ds.to_parquet(os.path.join(out, "train.parquet"))
"""


def prepare_mm_data(scratch: str, mt_python: str, shape: dict, timeout: int) -> dict:
    """The rows both trainers train on, written once: `images` 224x224 noise PNGs (Gemma3's preprocessing and
    omnijax's `image_size` both resize them to 896x896), each with a question and an answer; MaxText's tokenizer
    folder and parquet (made with mt_python), omnijax's shards (`recipes convert` with that tokenizer)."""
    import numpy as np
    from PIL import Image

    out = os.path.join(scratch, "mm")
    os.makedirs(os.path.join(out, "media"), exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(shape["images"]):
        pixels = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(out, "media", f"{i}.png"))
        rows.append({"image": f"media/{i}.png",
                     "question": f"What is shown in picture number {i}? Describe it briefly.",
                     "answer": f"Picture {i} shows random coloured noise with no recognisable object in it."})
    with open(os.path.join(out, "rows.json"), "w") as f:
        json.dump(rows, f)
    with open(os.path.join(out, "train.json"), "w") as f:  # LLaVA-style conversations for `recipes convert`
        json.dump([{"image": r["image"], "conversations": [{"from": "human", "value": "<image>\n" + r["question"]},
                                                            {"from": "gpt", "value": r["answer"]}]} for r in rows], f)
    env = _child_env(1, None, None, omnijax=False)
    rc, log, _, _ = _run([mt_python, "-c", _MM_MT_PREP, out], env, out, timeout)
    if rc != 0:
        raise _fail("MaxText data preparation", "mm", rc, log)
    data = {"tokenizer": os.path.join(out, "tokenizer"), "parquet": os.path.join(out, "train.parquet"),
            "shards": os.path.join(out, "shards")}
    cmd = [sys.executable, "-m", "recipes", "convert", f"input={os.path.join(out, 'train.json')}",
           f"output={data['shards']}", f"tokenizer.path={data['tokenizer']}"]
    env = _child_env(1, None, None, omnijax=True)
    rc, log, _, _ = _run(cmd, env, str(ROOT), timeout)
    if rc != 0:
        raise _fail("omnijax convert", "mm", rc, log)
    return data


def omnijax_metric_step_times(metrics_jsonl: str, warmup: int) -> list[float]:
    """Per-step seconds from a run's metrics.jsonl (`trainer.log_every=1`), its first ``warmup`` steps dropped."""
    return [r["step_time_s"] for r in read_metrics(metrics_jsonl) if "step_time_s" in r and r["step"] > warmup]


_MT_STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def maxtext_step_times(log: str, warmup: int) -> list[float]:
    """Per-step seconds from MaxText's log, steps below ``warmup`` dropped (compilation, first dispatches)."""
    return [float(s) for k, s in _MT_STEP.findall(log) if int(k) >= warmup]


# ------------------------------------------------------------------------------------- HLO profile
_SKIP = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")
_KEEP = ("fusion", "copy", "transpose", "dot", "convolution", "custom-call", "while", "conditional", "call",
         "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "dynamic-slice",
         "dynamic-update-slice", "reduce", "broadcast", "gather", "scatter", "sort", "convert")


def hlo_summary(text: str) -> dict:
    """Op counts of an optimised HLO module: what runs at the top level (the entry and the bodies of its
    loops and conditionals, i.e. not inside fusions), fusions by kind, and the ops fused inside them."""
    comps = parse_hlo(text)
    instrs = [ins for c in comps.values() for ins in c.instrs]
    fusion_bodies = {name for ins in instrs if ins.opcode == "fusion" for name in ins.called()}
    # reducers (to_apply of reduce, all-reduce, scatter, sort...) are counted nowhere; `call` bodies are top level
    reducers = {m.group(1) for ins in instrs if ins.opcode != "call"
                for m in [re.search(r"\bto_apply=%?([\w.\-]+)", ins.attrs)] if m}
    top: dict[str, int] = {}
    inside: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for name, comp in comps.items():
        if name in reducers and name not in fusion_bodies:
            continue
        target = inside if name in fusion_bodies else top
        for ins in comp.instrs:
            if ins.opcode in _SKIP:
                continue
            target[ins.opcode] = target.get(ins.opcode, 0) + 1
            if ins.opcode == "fusion" and target is top:
                k = re.search(r"kind=(k\w+)", ins.attrs)
                kinds[k.group(1) if k else "?"] = kinds.get(k.group(1) if k else "?", 0) + 1
    return {"top_level_ops": sum(top.values()), "top_level": {k: top[k] for k in _KEEP if k in top},
            "fusion_kinds": dict(sorted(kinds.items())), "inside_fusions": {k: inside[k] for k in _KEEP if k in inside},
            "inside_fusion_ops": sum(inside.values())}


def train_step_hlo(dump_dir: str) -> tuple[str, str] | None:
    """(file name, text) of the train step's optimised module in an --xla_dump_to folder (omnijax's program is
    ``jit_step``, MaxText's ``jit_train_step``; else the largest module)."""
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not files:
        return None
    steps = [f for f in files if re.search(r"\.jit_(train_)?step\.", os.path.basename(f))]
    best = max(steps or files, key=os.path.getsize)
    return os.path.basename(best), Path(best).read_text()


# ---------------------------------------------------------------------------------------- running
def _run(cmd: list[str], env: dict, cwd: str, timeout: int) -> tuple[int, str, float, float]:
    """(returncode, stdout+stderr, wall seconds, child CPU seconds) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        rc = 124
    except BaseException:  # interrupted: no trainer left running behind
        p.kill()
        raise
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rc, out, wall, cpu


def _child_env(devices: int, dump: str | None, preload: str | None, omnijax: bool) -> dict:
    """A child's environment: its fake devices, dump folder and allocator; omnijax's children import this checkout,
    MaxText's get no PYTHONPATH (its own environment only)."""
    env = dict(os.environ)
    if omnijax:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH", "")])])
    else:
        env.pop("PYTHONPATH", None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(("--xla_force_host_platform_device_count",
                                                                               "--xla_dump_to"))]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if dump:
        flags.append(f"--xla_dump_to={dump}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _fail(who: str, layout: str, rc: int, out: str) -> UserError:
    tail = "\n".join(out.strip().splitlines()[-15:])
    return UserError(f"bench maxtext: {who} {layout} exited {rc}:\n{tail}")


def run_omnijax(shape: dict, layout: str, opts: dict, remat: str, dump: str | None, preload: str | None,
                data: dict | None = None) -> dict:
    """One omnijax process: `bench llm_step` for the llama shapes, a `tiny_omni` training run on `data` for mm."""
    env = _child_env(1, dump, preload, omnijax=True)
    env["OMNIJAX_RUNS"] = env.get("OMNIJAX_RUNS", "runs") + "/bench_maxtext"
    if data is None:
        args = omnijax_overrides(shape, layout, remat, opts["steps"], opts["oj_warmup"]) + opts["oj"]
        cmd = [sys.executable, "-m", "recipes", "bench", "llm_step", *args]
    else:
        name = f"oj_mm_{os.getpid()}_{time.time_ns()}"
        args = omnijax_mm_overrides(shape, data, opts["steps"], opts["oj_warmup"]) + opts["oj"]
        cmd = [sys.executable, "-m", "recipes", "tiny_omni", *args, f"trainer.run_name={name}"]
    load = os.getloadavg()[0]
    rc, out, wall, cpu = _run(cmd, env, str(ROOT), opts["timeout_s"])
    if data is not None:
        metrics = Path(ROOT, env["OMNIJAX_RUNS"], name, "metrics.jsonl")
        times = omnijax_metric_step_times(str(metrics), opts["oj_warmup"]) if rc == 0 and metrics.exists() else []
        if not times:
            raise _fail("omnijax", layout, rc, out)
        loss = read_metrics(metrics)[-1]["loss"]
        return {"step_s": statistics.median(times), "steps": times, "loadavg": load, "wall_s": wall,
                "cpu_per_wall": cpu / wall, "step_cpu_per_wall": None,
                "allocator": (re.findall(r", allocator (.+)$", out, re.M) or ["?"])[0],
                "loss": loss, "command": " ".join(["python -m recipes tiny_omni", *args])}
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{") and '"variant"' in ln]
    row = next((r for r in rows if r["variant"] == layout), None)
    if rc != 0 or row is None:
        raise _fail("omnijax", layout, rc, out)
    return {"step_s": row["step_s"], "steps": row["step_s_per_round"], "loadavg": load, "wall_s": wall,
            "cpu_per_wall": cpu / wall, "step_cpu_per_wall": statistics.median(row["process_cpu_s_per_wall_s"]),
            "allocator": row["allocator"], "loss": row["loss"], "command": " ".join(["python -m recipes bench llm_step",
                                                                                     *args])}


def run_maxtext(shape: dict, layout: str, opts: dict, remat: str, base_yml: str, dump: str | None,
                preload: str | None, scratch: str, data: dict | None = None) -> dict:
    args = (maxtext_overrides(shape, layout, remat, opts["steps"], opts["warmup"]) if data is None else
            maxtext_mm_overrides(shape, data, opts["steps"], opts["warmup"])) + opts["mt"]
    args += [f"run_name=oj_cmp_{os.getpid()}_{time.time_ns()}", f"base_output_directory={scratch}"]
    cmd = [opts["mt_python"], "-m", "maxtext.trainers.pre_train.train", base_yml, *args]
    env = _child_env(1 if layout == "1dev" else 8, dump, preload, omnijax=False)
    env["DECOUPLE_GCLOUD"] = "TRUE"  # MaxText's switch for running without Google Cloud services
    load = os.getloadavg()[0]
    rc, out, wall, cpu = _run(cmd, env, scratch, opts["timeout_s"])
    times = maxtext_step_times(out, opts["warmup"])
    if rc != 0 or not times:
        raise _fail("MaxText", layout, rc, out)
    losses = re.findall(r"completed step: \d+, .*? loss: ([0-9.]+)", out)
    return {"step_s": statistics.median(times), "steps": times, "loadavg": load, "wall_s": wall,
            "cpu_per_wall": cpu / wall, "loss": float(losses[-1]) if losses else None,
            "command": " ".join(["python -m maxtext.trainers.pre_train.train", "MAXTEXT/configs/base.yml",
                                 *args[:-2]])}


def _measure(opts: dict, shape: dict, remat: str, base_yml: str, preload: str | None, scratch: str,
             data: dict | None = None) -> tuple[dict, dict]:
    """Every round: each layout as omnijax then MaxText (MaxText first in odd rounds)."""
    results: dict = {lay: {"omnijax": [], "maxtext": []} for lay in opts["layouts"]}
    profiles: dict = {lay: {} for lay in opts["layouts"]}
    for r in range(opts["rounds"]):
        for lay in opts["layouts"]:
            order = ("omnijax", "maxtext") if r % 2 == 0 else ("maxtext", "omnijax")
            for who in order:
                dump = os.path.join(opts["profile"], f"{who}_{lay}") if opts["profile"] and r == 0 else None
                if who == "omnijax":
                    res = run_omnijax(shape, lay, opts, remat, dump, preload, data)
                else:
                    res = run_maxtext(shape, lay, opts, remat, base_yml, dump, preload, scratch, data)
                results[lay][who].append(res)
                print(f"bench maxtext: round {r} {lay} {who}: {res['step_s']:.4f} s/step "
                      f"(load avg {res['loadavg']:.1f})", file=sys.stderr, flush=True)
                if dump:
                    found = train_step_hlo(dump)
                    if found:
                        profiles[lay][who] = {"module": found[0], **hlo_summary(found[1])}
            # the pair's ratio and the running median as they come: a run stopped early keeps its figures
            oj, mt = results[lay]["omnijax"], results[lay]["maxtext"]
            ratios = [m["step_s"] / o["step_s"] for o, m in zip(oj, mt)]
            print(f"bench maxtext: round {r} {lay} MaxText / omnijax {ratios[-1]:.3f} (median of {len(ratios)} "
                  f"round(s) {statistics.median(ratios):.3f} [{min(ratios):.3f} - {max(ratios):.3f}])",
                  file=sys.stderr, flush=True)
    return results, profiles


def run(overrides: list[str]) -> Iterator[dict]:
    import signal
    import tempfile
    import threading

    opts = parse_options(overrides)
    base_yml = maxtext_base_yml(opts["mt_python"])

    def stop(signum, frame):
        raise KeyboardInterrupt

    shape = SHAPES[opts["shape"]]
    remat = opts["remat"] or shape["remat"]
    # the same allocator for both: the one this process runs under (python -m recipes chose tcmalloc when installed)
    preload = os.environ.get("LD_PRELOAD") or None
    if preload is None and allocator.choice() != "system":
        preload = allocator.find_tcmalloc()
    scratch = tempfile.mkdtemp(prefix="bench_maxtext_")
    old = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:  # SIGTERM as Ctrl-C while children run (the running trainer is killed on the way out), then as before
        data = (prepare_mm_data(scratch, opts["mt_python"], shape, opts["timeout_s"]) if opts["shape"] == "mm"
                else None)
        results, profiles = _measure(opts, shape, remat, base_yml, preload, scratch, data)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    for lay in opts["layouts"]:
        oj, mt = results[lay]["omnijax"], results[lay]["maxtext"]
        ratios = [m["step_s"] / o["step_s"] for o, m in zip(oj, mt)]
        row = {"variant": lay, "shape": opts["shape"], **{f"shape_{k}": v for k, v in shape.items() if k != "remat"},
               "remat": remat, "rounds": opts["rounds"], "steps_per_process": opts["steps"],
               "ratio_maxtext_over_omnijax": round(statistics.median(ratios), 3),
               "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
               "ratio_per_round": [round(x, 3) for x in ratios],
               "omnijax_step_s": round(statistics.median(o["step_s"] for o in oj), 4),
               "maxtext_step_s": round(statistics.median(m["step_s"] for m in mt), 4),
               "omnijax_step_s_per_round": [round(o["step_s"], 4) for o in oj],
               "maxtext_step_s_per_round": [round(m["step_s"], 4) for m in mt],
               "omnijax_step_spread_per_round": [[round(min(o["steps"]), 3), round(max(o["steps"]), 3)] for o in oj],
               "maxtext_step_spread_per_round": [[round(min(m["steps"]), 3), round(max(m["steps"]), 3)] for m in mt],
               "omnijax_step_cpu_per_wall": [o["step_cpu_per_wall"] and round(o["step_cpu_per_wall"], 2) for o in oj],
               "omnijax_process_cpu_per_wall": [round(o["cpu_per_wall"], 2) for o in oj],
               "maxtext_process_cpu_per_wall": [round(m["cpu_per_wall"], 2) for m in mt],
               "loadavg_1min_at_start": [[round(o["loadavg"], 1), round(m["loadavg"], 1)] for o, m in zip(oj, mt)],
               "omnijax_loss": oj[-1]["loss"], "maxtext_loss": mt[-1]["loss"],
               "allocator": oj[0]["allocator"], "maxtext_preload": preload or "",
               "cpu_count": os.cpu_count(), "omnijax_command": oj[0]["command"], "maxtext_command": mt[0]["command"]}
        if profiles[lay]:
            row["hlo"] = profiles[lay]
        yield row

