"""Generation with a KV cache (omnijax.serve): cache decode = full recompute, greedy = transformers, sampling
seeded, EOS per row, tp2 = one device, multimodal prompts, and `recipes generate` end to end with bad input."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.config import from_dict
from omnijax.data import tokenizer
from omnijax.data.packing import SamplePacker
from omnijax.data.sample import Sample, Segment
from omnijax.errors import UserError
from omnijax.interop import pretrained
from omnijax.mm_config import MMConfig
from omnijax.models.llm import init_cache
from omnijax.models.mllm import MultimodalModel
from omnijax.serve.generate import Generator, SamplingConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(1, 30)), [42]]
NEW = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved by transformers and loaded with omnijax's HF loader."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # wide weights: near-ties in the argmax are rare, a wrong cache shows at once
        for p in ref.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("llama")
    ref.save_pretrained(path)
    model = pretrained.load_llm(path)
    gen = Generator(model)  # one device; shared by the tests (its compiled programs too)
    greedy = gen.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), batch_size=4)
    return ref, gen, greedy, path


def test_kv_cache_decode_equals_full_recompute(llama):
    """Prefill + teacher-forced decode steps give the full forward's logits at every decoded position, for
    one prompt and for a batch of prompts of different lengths (right-padded rows)."""
    gen = llama[1]
    model = nnx.merge(gen.graphdef, gen.params, gen.rest)
    rng = np.random.default_rng(1)
    prefill = jax.jit(lambda m, x, s, p, last, c: m.prefill(x, s, p, last, c))
    decode = jax.jit(lambda m, t, p, c: m.decode(t, p, c))
    full = jax.jit(lambda m, t: m(t))
    for lengths in ([9], [9, 3, 14]):
        b, steps, row = len(lengths), 6, 16
        seqs = [rng.integers(0, VOCAB, n + steps) for n in lengths]
        tokens = np.zeros((b, row), np.int32)
        seg = np.zeros((b, row), np.int32)
        pos = np.zeros((b, row), np.int32)
        for r, n in enumerate(lengths):
            tokens[r, :n], seg[r, :n], pos[r, :n] = seqs[r][:n], 1, np.arange(n)
        cache = init_cache(model.config, b, row + steps)
        logits, cache = prefill(model, model.embed(jnp.asarray(tokens)), jnp.asarray(seg), jnp.asarray(pos),
                                jnp.asarray(np.array(lengths) - 1), cache)
        got = [np.asarray(logits)]
        for t in range(steps - 1):
            feed = np.array([s[n + t] for s, n in zip(seqs, lengths)], np.int32)
            logits, cache = decode(model, jnp.asarray(feed), jnp.asarray(np.array(lengths) + t), cache)
            got.append(np.asarray(logits))
        for r, n in enumerate(lengths):
            ref = np.asarray(full(model, jnp.asarray(seqs[r][None, : n + steps - 1])))[0, n - 1:]
            mine = np.stack([g[r] for g in got])
            scale = np.abs(ref).max()
            assert np.abs(mine - ref).max() <= 1e-5 * scale, (lengths, r, np.abs(mine - ref).max(), scale)


def test_greedy_equals_transformers_and_layouts(llama):
    """Greedy tokens equal transformers' generate(do_sample=False) token for token, on one device, tp2 and
    dp2xtp2 (batches of other sizes), and the cache is split over kv heads under tp."""
    ref, gen, greedy, path = llama
    model = nnx.merge(gen.graphdef, gen.params, gen.rest)
    for p, g in zip(PROMPTS, greedy):  # no end id: the whole length
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(p):].tolist()
        assert g.tokens == out and g.prompt_tokens == p and g.finish_reason == "length"
    from omnijax.serve.load import _eos_ids
    eos = _eos_ids(tokenizer.BYTE_TOKENIZER, path)  # the folder's eos_token_id, as transformers reads it
    assert eos == (ref.generation_config.eos_token_id,)
    stopping = gen.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), batch_size=4, eos_ids=eos)
    for p, g in zip(PROMPTS, stopping):  # transformers stops at its eos and keeps it; `tokens` leave it out
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):]
        assert g.tokens + ([out[-1].item()] if g.finish_reason == "eos" else []) == out.tolist()
    assert any(g.finish_reason == "eos" for g in stopping), "no prompt reaches the eos: the check is empty"
    tp = Generator(model, layout="tp2")
    assert [g.tokens for g in tp.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), batch_size=4)] == \
        [g.tokens for g in greedy]
    mixed = Generator(model, layout="dp2xtp2").generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), batch_size=2)
    assert [g.tokens for g in mixed] == [g.tokens for g in greedy]
    batch = {"tokens": jnp.zeros((2, 16), jnp.int32), "segment_ids": jnp.ones((2, 16), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))}
    _, cache = tp._prefill(tp.params, batch, jnp.array([15, 15]), cache_len=32, zero_encoders=False)
    k = cache[0][0]
    assert k.shape == (2, 32, 2, 16) and k.sharding.shard_shape(k.shape) == (2, 32, 1, 16)


def test_sampling_is_seeded_and_top_p_narrows_to_greedy(llama):
    _, gen, greedy, _ = llama
    hot = SamplingConfig(max_new_tokens=NEW, temperature=1.5, top_p=0.95, seed=7)
    a = [g.tokens for g in gen.generate(PROMPTS, hot, batch_size=4)]
    b = [g.tokens for g in gen.generate(PROMPTS, hot, batch_size=2)]  # other batches: the same draws
    c = [g.tokens for g in gen.generate(PROMPTS, SamplingConfig(NEW, 1.5, 0.95, seed=8), batch_size=4)]
    assert a == b and a != c and a != [g.tokens for g in greedy]
    narrow = gen.generate(PROMPTS, SamplingConfig(NEW, temperature=1.0, top_p=1e-6, seed=3), batch_size=4)
    assert [g.tokens for g in narrow] == [g.tokens for g in greedy]  # only the most likely token survives


def _nucleus(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) restricted to the smallest set of most likely tokens whose probability reaches top_p,
    renormalised (float64, written here independently of the sampler)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def test_first_token_follows_softmax_over_the_nucleus(llama):
    """4096 first tokens of one prompt (1024 rows x 4 seeds: every draw has its own key) against
    softmax(logits / T) cut to top_p: no token outside the nucleus is ever drawn, and a chi-square test does not
    reject the distribution at 1e-3 (these seeds are fixed, so the test is deterministic; the level says how
    far the counts may stray from the expected ones by chance). The same counts reject a sampler off by a little
    in temperature or top_p, so the test has the power to see one."""
    from scipy import stats

    _, gen, _, _ = llama
    model = nnx.merge(gen.graphdef, gen.params, gen.rest)
    prompt = PROMPTS[0]
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray([prompt], jnp.int32)))[0, -1]
    temperature, top_p, rows = 0.3, 0.8, 1024
    draws = []
    for seed in range(4):
        cfg = SamplingConfig(max_new_tokens=1, temperature=temperature, top_p=top_p, seed=seed)
        draws += [g.tokens[0] for g in gen.generate([prompt] * rows, cfg, batch_size=512)]
    counts = np.bincount(draws, minlength=VOCAB)

    def chi2_p(q: np.ndarray) -> float:
        kept = q > 0
        if counts[~kept].any():
            return 0.0
        expected = q[kept] * len(draws)
        assert expected.min() >= 5, "cells too small for the chi-square approximation"
        return stats.chisquare(counts[kept], expected).pvalue

    want = _nucleus(logits, temperature, top_p)
    assert 8 <= (want > 0).sum() < VOCAB // 4    # a real cut: several tokens kept, most of the tail dropped
    assert not counts[want == 0].any()           # nothing outside the nucleus
    assert chi2_p(want) > 1e-3
    for t, p in ((temperature * 0.85, top_p), (temperature * 1.15, top_p), (temperature, top_p - 0.1),
                 (temperature, top_p + 0.1)):
        assert chi2_p(_nucleus(logits, t, p)) < 1e-6, (t, p)


def test_eos_stops_each_row(llama):
    """With eos = a token some rows produce, each row ends right before its own first eos; others run on."""
    _, gen, greedy, _ = llama
    eos = greedy[0].tokens[3]
    out = gen.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), batch_size=4, eos_ids=(eos,))
    for g, full in zip(out, greedy):
        if eos in full.tokens:
            assert g.tokens == full.tokens[: full.tokens.index(eos)] and g.finish_reason == "eos"
        else:
            assert g.tokens == full.tokens and g.finish_reason == "length"
    assert out[0].finish_reason == "eos"


MM = {"llm": {"vocab_size": 512, "embed_dim": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16,
              "mlp_dim": 64, "max_seq_len": 128},
      "encoders": {"vision": {"kind": "vit", "patch": 4, "temporal_patch": 2, "merge": 2, "max_side": 16,
                              "embed_dim": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64},
                   "audio": {"kind": "audio", "n_mels": 16, "reduction": 4, "embed_dim": 32, "num_layers": 1,
                             "num_heads": 2, "mlp_dim": 64}}}


def _mm_prompts():
    rng = np.random.default_rng(0)
    text = lambda s: Segment("text", tokenizer.encode(s))  # noqa: E731
    return [Sample((Segment("image", rng.random((16, 12, 3), np.float32)), text("what is it? "))),
            Sample((text("hear: "), Segment("audio", rng.standard_normal(3000).astype(np.float32)), text("ok"))),
            Sample((text("just text"),))]


@pytest.fixture(scope="module")
def mm_model():
    cfg = from_dict(MMConfig, MM)
    return cfg, MultimodalModel(cfg, rngs=nnx.Rngs(0))


def test_multimodal_greedy_equals_full_recompute(mm_model):
    """Media prompts: encoders fill the placeholders at prefill, then cached decoding; the reference appends
    each token and reruns the whole multimodal model (packed by the training packer) every step."""
    cfg, model = mm_model
    prompts = _mm_prompts()
    out = Generator(model, eos_ids=()).generate(prompts, SamplingConfig(max_new_tokens=6), batch_size=2)
    packer = SamplePacker(cfg, 1, 64, {"vision": 64, "audio": 64})
    forward = jax.jit(lambda m, b: m(b)[0])
    for p, g in zip(prompts, out):
        ids = []
        for _ in range(6):
            s = Sample(p.segments + ((Segment("text", np.array(ids, np.int32)),) if ids else ()))
            batch, used = packer.pack([s])
            n = int((batch["segment_ids"][0] > 0).sum())
            if not ids:
                assert g.prompt_tokens == batch["tokens"][0, :n].tolist()
            ids.append(int(np.argmax(np.asarray(forward(model, batch))[0, n - 1])))
        assert g.tokens == ids
    assert tokenizer.IMAGE in out[0].prompt_tokens and tokenizer.AUDIO in out[1].prompt_tokens


def _run_folder(root: Path, cfg: MMConfig, model) -> Path:
    """A run folder as the trainer writes it: config.json and an orbax checkpoint of a TrainState."""
    import dataclasses

    import optax

    from omnijax.train.checkpoint import Checkpointer
    from omnijax.train.state import init_state

    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg), "tokenizer": {"path": ""}}))
    ck = Checkpointer(run / "checkpoints", async_save=False)
    ck.save(5, init_state(nnx.state(model, nnx.Param), optax.adam(1e-3)), {"step": 5})
    ck.close()
    return run


@pytest.mark.slow
def test_generate_recipe_end_to_end_and_bad_input(mm_model, tmp_path):
    from PIL import Image

    from recipes import generate as recipe

    cfg, model = mm_model
    run = _run_folder(tmp_path, cfg, model)
    Image.fromarray((np.random.default_rng(0).random((20, 24, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    recs = [{"segments": [{"image": "a.png"}, {"text": "what colour? "}]},
            {"conversations": [{"from": "human", "value": "<image>\nhow many?"}, {"from": "gpt", "value": "two"}],
             "image": "a.png"},
            {"segments": [{"text": "the quick brown fox"}]}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.jsonl"
    assert recipe.main([str(run), f"prompts={prompts}", f"output={out}", "max_new_tokens=5"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(set(r) >= {"prompt_tokens", "tokens", "text", "finish_reason"} for r in rows)
    # the same model in the library gives the same tokens: the run folder's parameters were restored
    from omnijax.serve.prompts import read_prompts
    lib = Generator(model, eos_ids=(tokenizer.EOS,), pad_id=tokenizer.PAD).generate(
        read_prompts(prompts, tokenizer.BYTE_TOKENIZER), SamplingConfig(max_new_tokens=5))
    assert [r["tokens"] for r in rows] == [g.tokens for g in lib]
    assert [r["prompt_tokens"] for r in rows] == [g.prompt_tokens for g in lib]
    # an export folder (recipes export's format) of the same model gives the same answers
    from omnijax.interop import bundle
    exported = bundle.write_bundle(tmp_path / "export", cfg, nnx.state(model, nnx.Param))
    out2 = tmp_path / "out2.jsonl"
    assert recipe.main([str(exported), f"prompts={prompts}", f"output={out2}", "max_new_tokens=5"]) == 0
    assert [json.loads(line)["tokens"] for line in out2.read_text().splitlines()] == [r["tokens"] for r in rows]
    # the conversation: default template up to "Assistant:", the reference answer left out
    assert tokenizer.decode(rows[1]["prompt_tokens"]).endswith("how many?\nAssistant:")
    assert rows[2]["prompt_tokens"] == tokenizer.encode("the quick brown fox").tolist()
    with pytest.raises(UserError, match="prompts=.*nope.jsonl: file not found"):
        recipe.main([str(run), f"prompts={tmp_path / 'nope.jsonl'}", f"output={out}"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"segments": [{"image": "missing.png"}, {"text": "x"}]}) + "\n")
    with pytest.raises(UserError, match="record 0.*missing.png: media file not found"):
        recipe.main([str(run), f"prompts={bad}", f"output={out}"])
    with pytest.raises(UserError, match="neither a run folder"):
        recipe.main([str(tmp_path), f"prompts={prompts}", f"output={out}"])
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    with pytest.raises(UserError, match="has no checkpoint"):
        recipe.main([str(empty), f"prompts={prompts}", f"output={out}"])
    # the command line prints one line and exits non-zero
    cli = subprocess.run([sys.executable, "-m", "recipes", "generate", str(run), f"prompts={bad}", f"output={out}"],
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in cli.stderr.splitlines() if line.startswith("error:")]
    assert cli.returncode == 2 and len(lines) == 1 and "missing.png" in lines[0], cli.stderr[-500:]


def test_conversation_prompt_is_training_layout_up_to_the_answer(tmp_path):
    """A conversation prompt is exactly the tokens training sees before the answer, with the chat template's
    generation prompt; the trailing reference answer is left out (no jax involved)."""
    from test_tokenizer import make_hf

    from omnijax.data import formats

    tok = tokenizer.load_tokenizer(str(make_hf(tmp_path / "chatml")))
    conv = {"conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}],
            "image": "a.png"}
    media = lambda p, m: np.zeros((4, 4, 3), np.float32)  # noqa: E731
    resolve = Path
    parts = formats.prompt(conv, tok, media, resolve, "t")
    train = formats.build(conv, tok, media, resolve, "t")
    assert [m for m, _, _ in parts] == ["text", "image", "text"]
    ids = np.concatenate([v for m, v, _ in parts if m == "text"]).tolist()
    train_ids = np.concatenate([v for m, v, _ in train if m == "text"])
    train_loss = np.concatenate([np.full(len(v), bool(loss)) for m, v, loss in train if m == "text"])
    first_answer = int(np.argmax(train_loss))
    assert ids == train_ids[:first_answer].tolist()  # the same tokens as training, up to the answer
    rendered = formats.render(tok, [{"role": "user", "content": "<image>\nWhat is this?"}], add_generation_prompt=True)
    assert tok._tok.decode(ids, skip_special_tokens=False) == rendered.replace("<image>", "")
    assert rendered.endswith("<|im_start|>assistant\n")
