"""Preference pairs as the data plane's records: the pair forms `formats` reads, `convert` into shards, the
metadata sidecar, and the loader/packer putting a pair's two documents into one row with `pref_index`."""
import json

import numpy as np
import pytest

from omnijax.data import formats, records, sources
from omnijax.data import tokenizer as T
from omnijax.data.sample import CHOSEN, REJECTED, Sample

TOK = T.BYTE_TOKENIZER
PROMPT = [{"from": "human", "value": "<image>\nWhat colour?"}]
PAIRS = [
    {"segments": [{"text": "Q: sky colour? A: "}], "chosen": "blue", "rejected": "green"},
    {"text": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
    {"image": "a.png", "conversations": PROMPT, "chosen": {"from": "gpt", "value": "Red."}, "rejected": "Blue."},
    {"image": "a.png", "conversations": PROMPT + [{"from": "gpt", "value": "Blue.", "preference": "rejected"},
                                                 {"from": "gpt", "value": "Red.", "preference": "chosen"}]},
]
BAD = [
    ({"segments": [{"text": "Q: "}], "chosen": "a"}, "needs both 'chosen' and 'rejected'"),
    ({"segments": [{"text": "Q: "}], "chosen": "a", "rejected": "  "}, "the rejected answer is empty"),
    ({"conversations": PROMPT[:1] + [{"from": "gpt", "value": "x", "preference": "chosen"},
                                     {"from": "human", "value": "y"}]}, "last two turns"),
]


def _build(rec):
    return formats.build(json.loads(json.dumps(rec)), TOK, lambda p, m: (4, 4, 3), lambda p: p, "t[0]")


def _docs(parts):
    return [[(m, (v.tolist() if m == "text" else v), loss) for m, v, loss, p in map(formats.part_fields, parts)
             if p == role] for role in (CHOSEN, REJECTED)]


def test_pair_forms_and_bad_pairs():
    segs, text, conv, turns = (_build(r) for r in PAIRS)
    for parts, (good, bad) in ((segs, ("blue", "green")), (text, (" 4", " 5")), (conv, ("Red.", "Blue."))):
        chosen, rejected = _docs(parts)
        # the prompt is the same in both documents (media too); only the final answer carries loss
        assert chosen[:-1] == rejected[:-1] and not any(loss for *_, loss in chosen[:-1] if _[0] == "text")
        assert [p for p in chosen if p[2]] and [p for p in rejected if p[2]]
        answer = lambda doc: TOK.decode([t for m, v, loss in doc if loss for t in v])  # noqa: E731
        assert good in answer(chosen) and bad in answer(rejected) and bad not in answer(chosen)
    assert _docs(conv)[0][0][0] == "text" and ("image", (4, 4, 3), False) in _docs(conv)[0]
    assert _docs(turns) == _docs(conv)  # two marked assistant turns = top-level chosen/rejected
    for rec, why in BAD:
        with pytest.raises(records.BadRecord, match=why):
            _build(rec)
    # an unmarked conversation stays an ordinary one; a pair record's prompt is what generation starts from
    assert all(len(p) == 3 for p in _build({"conversations": [{"from": "human", "value": "hi"},
                                                              {"from": "gpt", "value": "a"}]}))
    assert formats.prompt(json.loads(json.dumps(PAIRS[3])), TOK, lambda p, m: (4, 4, 3), lambda p: p, "t")[-1][2] is False


@pytest.fixture(scope="module")
def pair_shards(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("pairs")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(d / "a.png")
    recs = [PAIRS[k % len(PAIRS)] for k in range(10)] + [BAD[0][0]]
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    from recipes import convert
    assert convert.main([f"input={d / 'p.jsonl'}", f"output={d / 'shards'}"]) == 0
    return d / "shards"


def test_pairs_convert_and_pack_into_one_row(pair_shards):
    info = records.read_dataset_info(pair_shards)
    assert info["records"] == 10 and info["skipped_bad"] == 1  # the pair without a rejected answer: skipped, counted
    (src,) = sources.open_sources([sources.SourceSpec("p", path=str(pair_shards))])
    for i in range(4):  # the sidecar's metadata (read without the record) = the record's own
        assert src.meta(i).is_pair and src.meta(i) == src.get(i).meta()
    from omnijax.train import multimodal
    from recipes import tiny_omni
    cfg = tiny_omni.load([f"data.sources=[{pair_shards}]", "data.batch_size=8", "capacity.vision=64",
                          "capacity.audio=8"])
    batch = next(multimodal.train_loader(cfg))
    pref, seg, mask = batch["pref_index"], batch["segment_ids"], batch["loss_mask"]
    pairs = 0
    for r in range(len(pref)):
        for slot in range(1, int(pref[r].max(initial=0)) + 1, 2):
            c, j = pref[r] == slot, pref[r] == slot + 1
            # both answers of a pair in this row, each its own document with answer (loss) tokens
            assert c.any() and j.any() and mask[r][c].sum() > 0 and mask[r][j].sum() > 0
            assert len(set(seg[r][c])) == 1 and len(set(seg[r][j])) == 1 and seg[r][c][0] != seg[r][j][0]
            assert np.all(batch["positions"][r][j] == np.arange(j.sum()))  # the rejected document starts at 0
            pairs += 1
    assert pairs >= 4 and not np.any(mask[pref == 0])  # every loss token belongs to a pair


def test_a_pairs_chosen_documents_score_as_their_plain_samples():
    """Each document of a pair is its own sample to the model: the chosen answers' log-probabilities inside the
    pairs equal the plain samples' (the prompt's media routed to both documents), on image and video prompts."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from omnijax.data.packing import SamplePacker
    from omnijax.data.world import World
    from omnijax.models import preference
    from omnijax.models.mllm import MultimodalModel
    from recipes import tiny_omni

    cfg = tiny_omni.load([])
    plain, pairs = (World(dataclasses.replace(cfg.world, pairs=p)) for p in (False, True))
    idx = [i for i in range(40) if plain.spec(i)["modality"] != "text"][:4]
    assert {plain.spec(i)["modality"] for i in idx} >= {"image", "video"}
    graph, params, rest = nnx.split(MultimodalModel(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    packer = SamplePacker(cfg.model, 4, 128, {"vision": 640, "audio": 512})
    fn = jax.jit(lambda p, b: preference.token_logps(nnx.merge(graph, p, rest)(b)[0], b["targets"], b["loss_mask"]))

    def logps(samples):
        batch, used = packer.pack(samples)
        assert len(used) == len(samples) and not packer.skipped
        jb = {k: jnp.asarray(v) for k, v in batch.items()}
        return jb, fn(params, jb)

    jb, lp = logps([pairs.sample(i) for i in idx])
    chosen, rejected = preference.pair_sums(lp, jb["pref_index"])
    _, alone = logps([plain.sample(i) for i in idx])
    np.testing.assert_allclose(float(jnp.sum(chosen)), float(jnp.sum(alone)), rtol=1e-5)
    # the rejected documents, taken out of their pairs as plain samples, score as inside them
    wrong = [Sample(tuple(dataclasses.replace(x, pair=0) for x in pairs.sample(i).segments if x.pair == REJECTED))
             for i in idx]
    _, alone = logps(wrong)
    np.testing.assert_allclose(float(jnp.sum(rejected)), float(jnp.sum(alone)), rtol=1e-5)
    assert int(jnp.sum(chosen != 0)) == len(idx) and float(jnp.sum(chosen)) != float(jnp.sum(rejected))
