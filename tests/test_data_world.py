"""The built-in world: deterministic, cheap metadata that matches the payload, learnable signals, heavy tails."""
import numpy as np
import pytest

from omnijax.data import tokenizer as T
from omnijax.data import world as W
from omnijax.data.sample import SAMPLE_RATE
from omnijax.errors import ConfigError, UserError

N = 300


@pytest.fixture(scope="module")
def world():
    return W.World(W.WorldConfig(seed=3))


@pytest.fixture(scope="module")
def items(world):
    return [world.item(i) for i in range(N)]


def test_deterministic_and_meta_matches_payload(world, items):
    again = W.World(W.WorldConfig(seed=3))
    for i in (0, 7, 123):
        a, b = items[i].sample, again.sample(i)
        assert all(np.array_equal(x.data, y.data) for x, y in zip(a.segments, b.segments))
    for i, it in enumerate(items):
        assert it.sample.validate().meta() == world.meta(i)
    assert {it.modality for it in items} == set(W.MODALITY_NAMES)


def test_eval_split_is_a_different_stream(world, items):
    ev = W.World(W.WorldConfig(seed=3), split="eval")
    specs = [(ev.spec(i)["modality"], ev.meta(i)) for i in range(50)]
    assert specs != [(world.spec(i)["modality"], world.meta(i)) for i in range(50)]
    scored = ev.eval_items(20)
    assert len(scored) == 20 and all(x.qtype != "caption" for x in scored)


def test_layout_answers_and_prompt(items):
    for it in items:
        segs = it.sample.segments
        assert segs[0].data.tolist() == [T.BOS] and segs[-1].loss and not any(s.loss for s in segs[:-1])
        assert T.decode(segs[-1].data) == it.answer and segs[-1].data[-1] == T.EOS
        if it.qtype != "caption":
            assert it.answer in W.QUESTIONS[it.qtype][2]
            assert T.decode(segs[-2].data).endswith(W.QUESTIONS[it.qtype][1] + "\nA: ")
        assert len(it.prompt().segments) == len(segs) - 1


def _colour_of(pixels):
    """Nearest palette colour of the saturated pixels (the shapes; the background is grey)."""
    flat = pixels.reshape(-1, 3)
    sat = flat.max(1) - flat.min(1)
    mean = flat[sat > 0.4].mean(0)
    return min(W.COLOURS, key=lambda c: np.sum((np.array(W.COLOURS[c]) - mean) ** 2))


def test_images_and_videos_carry_their_answers(world, items):
    checked = 0
    for i, it in enumerate(items):
        spec = world.spec(i)
        data = it.sample.segments[1].data
        if it.modality in ("image", "video"):
            assert _colour_of(data) == spec["colour"]
            checked += 1
        if it.modality == "video" and data.shape[0] >= 2:
            def centre(f):
                m = (f.max(-1) - f.min(-1)) > 0.4
                ys, xs = np.nonzero(m)
                return ys.mean(), xs.mean()
            (y0, x0), (y1, x1) = centre(data[0]), centre(data[-1])
            moved = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}
            assert max(moved, key=moved.get) == spec["direction"]
        if it.modality == "image" and spec["count"] == 1:
            m = (data.max(-1) - data.min(-1)) > 0.4
            ys, xs = np.nonzero(m)
            h, w = m.shape
            q = 2 * int(ys.mean() >= h / 2) + int(xs.mean() >= w / 2)
            assert q == spec["quadrants"][0]
    assert checked > 50


def test_audio_first_tone_is_the_first_item(world, items):
    n = 0
    for i, it in enumerate(items):
        spec = world.spec(i)
        if it.modality != "audio":
            continue
        wave = it.sample.segments[1].data
        start = int(spec["lead_s"] * SAMPLE_RATE)
        clip = wave[start: start + int(0.05 * SAMPLE_RATE)]
        spectrum = np.abs(np.fft.rfft(clip * np.hanning(clip.size)))
        peak = np.fft.rfftfreq(clip.size, 1 / SAMPLE_RATE)[spectrum.argmax()]
        first = int(spec["items"][0]) if spec["kind"] == "digits" else W.WORDS[spec["items"][0]][0]
        assert min(range(10), key=lambda d: abs(W.World.tone_hz(d) - peak)) == first
        n += 1
    assert n > 30


def test_lengths_are_heavy_tailed_and_reported(world):
    report = W.token_report(world, n=1500)
    assert set(report) == {"all", *W.MODALITY_NAMES}
    enc = report["all"]["encoder_rows"]
    assert enc["p99"] > 5 * enc["p50"] and enc["max"] > enc["p99"]
    assert report["text"]["llm_tokens"]["p99"] > 3 * report["text"]["llm_tokens"]["p50"]
    light = W.World(W.WorldConfig(seed=3, image_side=W.Tail(16, 128, 8.0), weights={"image": 1.0}))
    assert W.token_report(light, n=300)["image"]["encoder_rows"]["p90"] < report["image"]["encoder_rows"]["p90"]


def test_chance_and_config_errors():
    assert W.chance("video") == 0.25 and W.chance("text") == 1 / 8
    assert 0.25 < W.chance("image") < 0.34
    with pytest.raises(ConfigError, match="weights.smell"):
        W.World(W.WorldConfig(weights={"smell": 1.0}))
    with pytest.raises(ConfigError, match="alpha"):
        W.World(W.WorldConfig(audio_items=W.Tail(1, 4, 0.0)))
    with pytest.raises(UserError, match="split"):
        W.World(split="test")


def test_specs_are_cached_without_changing_a_sample():
    import pickle

    w = W.World(W.WorldConfig(seed=3))
    first = [w.meta(i) for i in range(40)]
    assert all(w.spec(i) is w.spec(i) for i in range(40))               # meta then item draw once
    fresh = W.World(W.WorldConfig(seed=3))
    assert [fresh._draw_spec(i) for i in range(40)] == [w.spec(i) for i in range(40)]
    assert first == [fresh.meta(i) for i in range(40)]
    copy = pickle.loads(pickle.dumps(w))
    assert copy._specs == {} and copy.spec(7) == w.spec(7)
