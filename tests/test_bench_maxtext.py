"""`bench maxtext` without MaxText: options, clear errors without a MaxText environment, the overrides both sides
would get, the log/HLO readers, and the round order with stand-in trainers. None of these tests runs MaxText (it
stays out of omnijax's dependencies and is not installed here): a wrong MaxText command line or a MaxText change
that breaks the comparison is not caught here, only by `python -m recipes bench maxtext mt_python=...`."""
from __future__ import annotations

import sys

import pytest

from omnijax.errors import UserError
from recipes.bench import maxtext as bm


def test_options_defaults_and_lists():
    o = bm.parse_options(["mt_python=/x", "layouts=[1dev, dp8]", "rounds=5", "oj.parallel.rules=llm_5d",
                          "mt.scan_layers=False"])
    assert o["layouts"] == ["1dev", "dp8"] and o["rounds"] == 5 and o["steps"] == 12
    assert o["oj"] == ["parallel.rules=llm_5d"] and o["mt"] == ["scan_layers=False"]
    large = bm.parse_options(["shape=large"])
    assert large["steps"] == 3 and large["oj_warmup"] == 1 and o["oj_warmup"] == 2


@pytest.mark.parametrize("bad", [["shape=huge"], ["layouts=[tp8]"], ["rounds=0"], ["remat=dots"], ["colour=red"],
                                 ["novalue"]])
def test_bad_options_are_user_errors(bad):
    with pytest.raises(UserError):
        bm.parse_options(bad)


def test_mt_python_missing_or_without_maxtext(tmp_path):
    with pytest.raises(UserError, match="needs mt_python"):
        bm.maxtext_base_yml("")
    with pytest.raises(UserError, match="no such executable"):
        bm.maxtext_base_yml(str(tmp_path / "nope" / "python"))
    with pytest.raises(UserError, match="cannot import maxtext"):
        bm.maxtext_base_yml(sys.executable)  # the test environment has no maxtext


def test_run_stops_before_measuring_without_maxtext_installed():
    with pytest.raises(UserError, match="cannot import maxtext"):
        list(bm.run([f"mt_python={sys.executable}", "layouts=[1dev]", "rounds=1"]))


def test_overrides_give_both_sides_the_same_shape_and_layout_maxtext_not_run():
    s = bm.LARGE
    oj = bm.omnijax_overrides(s, "fsdp8", "full", steps=4, warmup=2)
    mt = bm.maxtext_overrides(s, "fsdp8", "full", steps=4, warmup=2)
    assert "parallel.llm=fsdp8" in oj and "parallel.cpu_devices=8" in oj and "bench.only=parallel" in oj
    assert "trainer.compute_dtype=bfloat16" in oj and "parallel.remat=full" in oj and "bench.repeats=4" in oj
    assert f"model.num_kv_heads={s['kv_heads']}" in oj and f"base_num_kv_heads={s['kv_heads']}" in mt
    assert "ici_fsdp_parallelism=8" in mt and f"per_device_batch_size={s['batch'] // 8}" in mt
    assert "remat_policy=full" in mt and "dtype=bfloat16" in mt and "weight_dtype=float32" in mt and "steps=6" in mt
    dp = bm.maxtext_overrides(bm.TINY, "dp8", "none", steps=3, warmup=4)
    assert "ici_data_parallelism=8" in dp and "ici_fsdp_parallelism=1" in dp and "scan_layers=False" in dp
    one = bm.maxtext_overrides(bm.TINY, "1dev", "none", steps=3, warmup=4)
    assert f"per_device_batch_size={bm.TINY['batch']}" in one
    assert not any(a.startswith("parallel.") for a in bm.omnijax_overrides(bm.TINY, "1dev", "none", 3, 2)
                   if not a.startswith("parallel.remat"))


def test_maxtext_log_reader_drops_warmup_steps_on_a_canned_log():
    log = "\n".join(f"I1206 metric_logger.py:265] completed step: {k}, seconds: {t}, TFLOP/s/device: 1.0, loss: 9.0"
                    for k, t in enumerate([0.06, 0.4, 6.3, 3.7, 3.1, 3.2]))
    assert bm.maxtext_step_times(log, warmup=4) == [3.1, 3.2]


HLO = """HloModule jit_step

%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %t = f32[4]{0} transpose(f32[4]{0} %p0), dimensions={0}
  ROOT %a = f32[4]{0} add(f32[4]{0} %t, f32[4]{0} %p1)
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (a: f32[4], b: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = f32[4]{0} copy(f32[4]{0} %a)
  %f = f32[4]{0} fusion(f32[4]{0} %c, f32[4]{0} %b), kind=kLoop, calls=%fused_add
  %w = (s32[], f32[4]{0}, /*index=2*/f32[4]{0}) tuple(s32[] %i, f32[4]{0} %a, f32[4]{0} %b)
  %l = (s32[], f32[4]{0}, /*index=2*/f32[4]{0}) while((s32[], f32[4]{0}, /*index=2*/f32[4]{0}) %w), condition=%c, body=%b
  ROOT %r = f32[4]{0} all-reduce(f32[4]{0} %f), replica_groups={}, to_apply=%sum
}
"""


def test_hlo_summary_counts_top_level_and_fused_ops():
    s = bm.hlo_summary(HLO)
    assert s["top_level"] == {"fusion": 1, "copy": 1, "while": 1, "all-reduce": 1}  # a tuple-typed op counts too
    assert s["fusion_kinds"] == {"kLoop": 1}
    assert s["inside_fusions"] == {"transpose": 1} and s["inside_fusion_ops"] == 2  # the reducer's add not counted


def test_train_step_module_is_picked_by_name(tmp_path):
    (tmp_path / "module_0000.jit_init.cpu_after_optimizations.txt").write_text("x" * 1000)
    (tmp_path / "module_0002.jit_step.cpu_after_optimizations.txt").write_text(HLO)
    name, text = bm.train_step_hlo(str(tmp_path))
    assert name.startswith("module_0002.jit_step") and text == HLO
    assert bm.train_step_hlo(str(tmp_path / "empty")) is None


def test_mm_overrides_are_one_device_and_give_both_sides_the_same_sizes_maxtext_not_run(tmp_path):
    o = bm.parse_options(["shape=mm"])
    assert o["layouts"] == ["1dev"] and o["steps"] == 4 and o["oj_warmup"] == 2
    for bad in (["shape=mm", "layouts=[fsdp8]"], ["shape=mm", "remat=full"]):
        with pytest.raises(UserError):
            bm.parse_options(bad)
    s, data = bm.MM, {"shards": "S", "tokenizer": "T", "parquet": "P.parquet"}
    oj = bm.omnijax_mm_overrides(s, data, steps=4, warmup=2)
    mt = bm.maxtext_mm_overrides(s, data, steps=4, warmup=3)
    grid = s["image"] // s["patch"]
    assert "data.sources=[S]" in oj and "tokenizer.path=T" in oj and "trainer.steps=6" in oj
    assert "hf_train_files=P.parquet" in mt and "tokenizer_path=T" in mt and "steps=7" in mt
    # the tokenizer's vocabulary plus omnijax's image/video/audio placeholders fit; tied, as Gemma3's
    assert int(next(a for a in oj if a.startswith("model.llm.vocab_size=")).split("=")[1]) >= s["vocab"] + 3
    assert "model.llm.tie_embeddings=true" in oj
    # the same image grid reaches the same number of LLM tokens: 896/14 = 64 patches a side, 4x4 -> 256
    assert f"model.encoders.vision.image_size={s['image']}" in oj and f"model.encoders.vision.merge={s['pool']}" in oj
    assert (grid // s["pool"]) ** 2 == 256 and f"capacity.vision={s['batch'] * grid * grid}" in oj
    for k_oj, k_mt in [("model.llm.num_kv_heads", "base_num_kv_heads"), ("model.llm.mlp_dim", "base_mlp_dim"),
                       ("model.encoders.vision.embed_dim", "hidden_size_for_vit"),
                       ("model.encoders.vision.num_layers", "num_hidden_layers_for_vit"),
                       ("data.batch_size", "per_device_batch_size"), ("data.seq_len", "max_target_length")]:
        v_oj = next(a for a in oj if a.startswith(k_oj + "=")).split("=")[1]
        v_mt = next(a for a in mt if a.startswith(k_mt + "=")).split("=")[1]
        assert v_oj == v_mt, (k_oj, v_oj, k_mt, v_mt)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(f'{{"step": {k}, "loss": 1.0, "step_time_s": {t}}}' for k, t in
                                 enumerate([13.7, 4.1, 4.0, 3.9], start=1)) + "\n")
    assert bm.omnijax_metric_step_times(str(metrics), warmup=2) == [4.0, 3.9]


def test_rounds_alternate_and_each_pair_is_reported_with_stand_in_trainers_maxtext_not_run(monkeypatch, capsys):
    """The order of the trainers alternates by round, and each pair's ratio reaches stderr at once (a run stopped
    early keeps its figures); both trainers are stand-ins here with known step times."""
    calls = []

    def fake(who, step_s):
        def run(shape, lay, opts, *args, **kw):
            calls.append((who, lay))
            return {"step_s": step_s[lay], "steps": [step_s[lay]], "loadavg": 0.0}
        return run

    monkeypatch.setattr(bm, "run_omnijax", fake("omnijax", {"1dev": 1.0, "fsdp8": 0.5}))
    monkeypatch.setattr(bm, "run_maxtext", fake("maxtext", {"1dev": 1.25, "fsdp8": 0.6}))
    opts = bm.parse_options(["layouts=[1dev,fsdp8]", "rounds=2"])
    results, _ = bm._measure(opts, bm.TINY, "none", "base.yml", None, "/tmp")
    assert calls == [("omnijax", "1dev"), ("maxtext", "1dev"), ("omnijax", "fsdp8"), ("maxtext", "fsdp8"),
                     ("maxtext", "1dev"), ("omnijax", "1dev"), ("maxtext", "fsdp8"), ("omnijax", "fsdp8")]
    assert [len(results[lay]["omnijax"]) for lay in ("1dev", "fsdp8")] == [2, 2]
    err = capsys.readouterr().err
    assert "round 0 1dev MaxText / omnijax 1.250 (median of 1 round(s) 1.250" in err
    assert "round 1 fsdp8 MaxText / omnijax 1.200 (median of 2 round(s) 1.200 [1.200 - 1.200])" in err
