"""Media decoding (Pillow, PyAV, soundfile + soxr): round trips, header shapes == decoded shapes, frame
sampling, resampling accuracy, and BadSample (never another exception) for missing/corrupt/unsupported files."""
import math
from fractions import Fraction

import numpy as np
import pytest
import soxr
from PIL import Image, ImageOps

from omnijax.config import MediaConfig
from omnijax.data import media
from omnijax.data.sample import SAMPLE_RATE, BadSample


def _load(path, modality, cfg=None):
    """load_media, checking that media_shape (headers only) predicted its shape."""
    shape = media.media_shape(path, modality, cfg)
    x = media.load_media(path, modality, cfg)
    assert x.dtype == np.float32 and x.shape == shape, (path.name, x.shape, shape)
    return x


def _smooth(h, w):
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([y / (h - 1), x / (w - 1), 0.5 + 0.3 * np.sin(x / 3.0)], -1)


# ------------------------------------------------------------------------------------ images
@pytest.mark.parametrize("ext,tol", [(".png", 0.0), (".bmp", 0.0), (".jpg", 0.03), (".jpeg", 0.03), (".webp", 0.03)])
def test_image_round_trip(tmp_path, ext, tol):
    rng = np.random.default_rng(0)
    img = (rng.integers(0, 256, (12, 18, 3)) / 255.0) if tol == 0 else _smooth(12, 18)
    media.write_image(tmp_path / f"a{ext}", img)
    x = _load(tmp_path / f"a{ext}", "image")
    assert x.shape == (12, 18, 3) and x.min() >= 0 and x.max() <= 1
    if tol == 0:
        assert np.array_equal(np.round(x * 255), np.round(img * 255))
    else:
        assert np.abs(x - img).mean() < tol


def test_png_16bit_grey_scales_by_65535(tmp_path):
    v = np.array([[0, 1, 257, 1000], [30000, 40000, 65534, 65535]], np.uint16)
    Image.fromarray(v).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    x = _load(tmp_path / "g16.png", "image")
    assert np.allclose(x, np.repeat((v / 65535.0)[..., None], 3, -1), atol=1e-6)  # 8-bit truncation would fail


def test_palette_grey_and_cmyk(tmp_path):
    pal = Image.new("P", (4, 2))
    pal.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    pal.putdata([0, 1, 2, 0, 2, 1, 0, 0])
    pal.save(tmp_path / "p.png")
    x = _load(tmp_path / "p.png", "image")
    assert np.array_equal(x[0, :3], np.eye(3, dtype=np.float32)) and np.array_equal(x[1, 0], [0, 0, 1])
    Image.fromarray(np.array([[0, 128, 255]], np.uint8), "L").save(tmp_path / "l.png")
    assert np.allclose(_load(tmp_path / "l.png", "image")[0], np.repeat([[0, 128 / 255, 1]], 3, 0).T)
    cmyk = Image.fromarray((_smooth(8, 8) * 255).astype(np.uint8)).convert("CMYK")
    cmyk.save(tmp_path / "c.jpg", quality=95)
    ref = np.asarray(Image.open(tmp_path / "c.jpg").convert("RGB"), np.float32) / 255
    assert Image.open(tmp_path / "c.jpg").mode == "CMYK"
    assert np.allclose(_load(tmp_path / "c.jpg", "image"), ref)


def test_alpha_is_composited_onto_white(tmp_path):
    rgba = np.array([[[200, 0, 0, 255], [200, 0, 0, 0], [0, 0, 0, 128]]], np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    x = _load(tmp_path / "a.png", "image")
    a = 128 / 255
    assert np.allclose(x[0], [[200 / 255, 0, 0], [1, 1, 1], [1 - a] * 3], atol=1e-6)
    Image.fromarray(np.array([[[0, 0], [0, 255]]], np.uint8), "LA").save(tmp_path / "la.png")
    assert np.allclose(_load(tmp_path / "la.png", "image")[0], [[1, 1, 1], [0, 0, 0]])
    pal = Image.new("P", (2, 1))
    pal.putpalette([10, 20, 30, 40, 50, 60] + [0] * 762)
    pal.putdata([0, 1])
    pal.save(tmp_path / "pt.png", transparency=0)
    assert np.allclose(_load(tmp_path / "pt.png", "image")[0], [[1, 1, 1], [40 / 255, 50 / 255, 60 / 255]])


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation(tmp_path, orientation):
    px = (np.random.default_rng(orientation).random((6, 10, 3)) * 255).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    for ext in (".jpg", ".png", ".webp"):
        p = tmp_path / f"r{ext}"
        Image.fromarray(px).save(p, exif=exif, **({"lossless": True} if ext == ".webp" else {}))
        ref = np.asarray(ImageOps.exif_transpose(Image.open(p)).convert("RGB"), np.float32) / 255
        x = _load(p, "image")
        assert x.shape[:2] == ((10, 6) if orientation >= 5 else (6, 10)), ext
        assert np.array_equal(x, ref), ext


# ------------------------------------------------------------------------------------- video
def _coded_video(path, n, fps, gop=None):
    """n frames whose brightness encodes the frame index (i / 19)."""
    frames = np.broadcast_to((np.arange(n) / 19.0)[:, None, None, None], (n, 32, 32, 3))
    media.write_video(path, frames, fps, gop=gop)


def _indices(x):
    return np.round(x.mean(axis=(1, 2, 3)) * 19).astype(int).tolist()


# (frames, source fps, video_fps, max_video_frames)
_CASES = [(20, 10, 2.0, 64), (20, 10, 3.0, 64), (7, 5, 2.0, 64), (1, 5, 2.0, 64), (20, 10, 10.0, 6),
          (20, 10, 100.0, 0), (13, 24, 7.0, 64), (20, 7.5, 0.5, 64), (20, 30000 / 1001, 11.0, 4)]


@pytest.mark.parametrize("ext", [".mp4", ".mkv", ".webm"])  # mkv/webm headers carry no per-stream frame count
def test_video_sampling_keeps_the_right_frames(tmp_path, ext):
    for n, src, fps, cap in _CASES:
        p = tmp_path / f"v{n}_{src:.3f}{ext}"
        _coded_video(p, n, src)
        src_f = Fraction(src).limit_denominator(1001)
        dur = n / src_f
        eff = min(Fraction(fps).limit_denominator(1_000_000), src_f)
        t = max(1, math.ceil(dur * eff))
        times = [dur * k / cap for k in range(cap)] if 0 < cap < t else [k / eff for k in range(t)]
        want = [min(n - 1, math.ceil(tk * src_f - Fraction(1, 2))) for tk in times]  # nearest, ties earlier
        x = _load(p, "video", MediaConfig(video_fps=fps, max_video_frames=cap))
        assert x.shape == (len(want), 32, 32, 3), (n, src, fps, cap)
        assert _indices(x) == want, (n, src, fps, cap)


def test_video_seeking_matches_sequential_decoding(tmp_path, monkeypatch):
    cfg = MediaConfig(video_fps=10, max_video_frames=4)  # targets 0.5 s apart, keyframes every 3 frames
    for ext in (".mp4", ".mkv"):
        p = tmp_path / f"g{ext}"
        _coded_video(p, 20, 10, gop=3)
        got = {}
        for gap in (0.0, 1e9):
            monkeypatch.setattr(media, "SEEK_GAP_S", gap)
            c = media._open_video(p)
            s, dur, rate, h, w = media._probe(p, c)
            stats = {}
            frames = media._decode_at(c, s, media.frame_times(dur, cfg, rate), h, w, stats)
            c.close()
            got[gap] = (_indices(np.stack(frames) / 255.0), stats)
        assert got[0.0][0] == got[1e9][0] == [0, 5, 10, 15], ext
        assert got[0.0][1]["seeks"] > 0 and got[0.0][1]["decoded"] < got[1e9][1]["decoded"], (ext, got)
        assert got[1e9][1]["seeks"] == 0


def test_video_cut_short_repeats_its_last_frame(tmp_path):
    """An mkv whose tail is lost still says 2 s in its header: shape and load agree, the end repeats."""
    p = tmp_path / "cut.mkv"
    _coded_video(p, 20, 10)
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * 0.85)])  # the header and first keyframe take most of this tiny file
    cfg = MediaConfig(video_fps=10, max_video_frames=0)
    x = _load(p, "video", cfg)
    idx = _indices(x)
    assert len(idx) == 20 and idx[0] == 0 and idx[-1] < 19 and idx[-1] == idx[-2]
    assert idx == list(range(idx[-1] + 1)) + [idx[-1]] * (19 - idx[-1])


def test_mp4_display_rotation_is_applied(tmp_path):
    """Phone portrait clips: landscape frames plus a rotation in the header; both paths show them upright."""
    import av
    px = np.zeros((2, 16, 32, 3))
    px[:, :8, :8] = 1.0  # a white top-left corner
    for deg in (0, 90, 180, 270):
        p = tmp_path / f"r{deg}.mp4"
        media.write_video(p, px, 5, rotation=deg)
        with av.open(str(p)) as c:
            assert media.mp4_rotation(p) == next(c.decode(video=0)).rotation % 360 == deg  # FFmpeg agrees
        x = _load(p, "video")
        assert np.allclose(x, np.rot90(px, deg // 90, axes=(1, 2)), atol=0.05), deg


def test_write_video_rejects_odd_sides(tmp_path):
    with pytest.raises(ValueError, match="even"):
        media.write_video(tmp_path / "o.mp4", np.zeros((2, 31, 32, 3)), 5)


# ------------------------------------------------------------------------------------- audio
@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_resampled_length_formula(tmp_path, rate):
    for n in (1, 2, 3, 7, 441, 1000, 4410, 22051):
        assert soxr.resample(np.zeros(n, np.float32), rate, SAMPLE_RATE).size == media.resampled_len(n, rate)
    for n in (1, 999, 4411):
        media.write_audio(tmp_path / "a.flac", np.full(n, 0.1, np.float32), rate)
        assert _load(tmp_path / "a.flac", "audio").shape == (media.resampled_len(n, rate),)


@pytest.mark.parametrize("ext,tol", [(".wav", 2e-3), (".flac", 2e-3), (".ogg", 0.05), (".mp3", None)])
def test_audio_resampling_keeps_a_440hz_sine(tmp_path, ext, tol):
    rate = 44100
    wave = 0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)
    media.write_audio(tmp_path / f"s{ext}", wave, rate)
    x = _load(tmp_path / f"s{ext}", "audio")
    assert x.shape == (16000,)
    ref = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / SAMPLE_RATE)
    if tol is not None:  # mp3 decoders shift the signal by the codec delay: frequency check only
        assert np.abs(x - ref)[200:-200].max() < tol
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    assert abs(np.argmax(spec) * SAMPLE_RATE / x.size - 440) <= 1


def test_audio_resampling_removes_what_16khz_cannot_hold(tmp_path):
    """A 12 kHz tone at 44.1 kHz is above the 8 kHz Nyquist limit: a proper low-pass resampler drops it,
    interpolation would fold it onto 4 kHz."""
    rate = 44100
    t = np.arange(rate) / rate
    media.write_audio(tmp_path / "mix.wav", 0.4 * np.sin(2 * np.pi * 440 * t) + 0.4 * np.sin(2 * np.pi * 12000 * t), rate)
    x = _load(tmp_path / "mix.wav", "audio")
    ref = 0.4 * np.sin(2 * np.pi * 440 * np.arange(16000) / SAMPLE_RATE)
    assert np.abs(x - ref)[200:-200].max() < 2e-3


def test_audio_channels_are_averaged(tmp_path):
    t = np.arange(16000) / 16000
    left, right = 0.4 * np.sin(2 * np.pi * 300 * t), 0.2 * np.sin(2 * np.pi * 700 * t)
    media.write_audio(tmp_path / "st.wav", np.stack([left, right], 1), 16000)
    assert np.abs(_load(tmp_path / "st.wav", "audio") - (left + right) / 2).max() < 1e-4


def test_zero_length_audio_is_a_bad_sample(tmp_path):
    media.write_audio(tmp_path / "empty.wav", np.zeros(0, np.float32), 16000)
    for fn in (media.media_shape, media.load_media):
        with pytest.raises(BadSample, match="empty.wav: zero-length audio"):
            fn(tmp_path / "empty.wav", "audio")


def test_npy_still_supported(tmp_path):
    np.save(tmp_path / "c.npy", np.full((2, 4, 4, 3), 255, np.uint8))
    assert np.array_equal(_load(tmp_path / "c.npy", "video"), np.ones((2, 4, 4, 3), np.float32))


# ------------------------------------------------------------------------------------ errors
def _valid_files(tmp_path):
    media.write_image(tmp_path / "ok.jpg", _smooth(16, 16))
    media.write_image(tmp_path / "ok.png", _smooth(16, 16))
    media.write_image(tmp_path / "ok.webp", _smooth(16, 16))
    _coded_video(tmp_path / "ok.mp4", 6, 5)
    _coded_video(tmp_path / "ok.webm", 6, 5)
    media.write_audio(tmp_path / "ok.wav", np.zeros(800), 8000)
    media.write_audio(tmp_path / "ok.flac", np.zeros(800), 8000)
    return {"ok.jpg": "image", "ok.png": "image", "ok.webp": "image", "ok.mp4": "video", "ok.webm": "video",
            "ok.wav": "audio", "ok.flac": "audio"}


def test_corrupt_files_are_bad_samples_naming_the_file(tmp_path):
    _valid_files(tmp_path)
    data = (tmp_path / "ok.jpg").read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadSample, match=r"trunc\.jpg: corrupt or truncated image"):
        media.load_media(tmp_path / "trunc.jpg", "image")
    rnd = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    for name, modality in (("noise.mp4", "video"), ("noise.png", "image"), ("noise.flac", "audio")):
        (tmp_path / name).write_bytes(rnd)
        for fn in (media.media_shape, media.load_media):
            with pytest.raises(BadSample, match=rf"{name}: corrupt or truncated {modality}"):
                fn(tmp_path / name, modality)
    wav = bytearray((tmp_path / "ok.wav").read_bytes())
    wav[8:12] = b"JUNK"  # 'WAVE' tag broken
    (tmp_path / "hdr.wav").write_bytes(bytes(wav))
    for fn in (media.media_shape, media.load_media):
        with pytest.raises(BadSample, match=r"hdr\.wav: corrupt or truncated audio"):
            fn(tmp_path / "hdr.wav", "audio")


def test_missing_and_unsupported_are_told_apart(tmp_path):
    (tmp_path / "x.tiff").write_bytes(b"II*\x00")
    (tmp_path / "x.png").write_bytes(b"\x89PNG")
    for fn in (media.media_shape, media.load_media):
        with pytest.raises(BadSample, match=r"x\.tiff: unsupported image format .*supported: \.jpg"):
            fn(tmp_path / "x.tiff", "image")
        with pytest.raises(BadSample, match=r"x\.png: unsupported audio format"):
            fn(tmp_path / "x.png", "audio")
        for name, modality in (("gone.jpg", "image"), ("gone.mp4", "video"), ("gone.wav", "audio")):
            with pytest.raises(BadSample, match=rf"{name}: media file not found"):
                fn(tmp_path / name, modality)


def test_damaged_files_raise_only_bad_sample(tmp_path):
    """Truncations and flipped bytes of every format: either a consistent decode or BadSample, nothing else."""
    files = _valid_files(tmp_path)
    rng = np.random.default_rng(1)
    cfg = MediaConfig(video_fps=5)
    for name, modality in files.items():
        data = (tmp_path / name).read_bytes()
        variants = [data[:k] for k in (0, 4, 16, 64, len(data) // 3, len(data) - 5)]
        for _ in range(4):
            b = bytearray(data)
            pos = rng.integers(0, len(b), 8)
            b_arr = np.frombuffer(bytes(b), np.uint8).copy()
            b_arr[pos] ^= 0xFF
            variants.append(b_arr.tobytes())
        for i, v in enumerate(variants):
            p = tmp_path / f"d{i}_{name}"
            p.write_bytes(v)
            try:
                shape = media.media_shape(p, modality, cfg)
            except BadSample as exc:
                assert p.name in str(exc)
                continue
            try:
                x = media.load_media(p, modality, cfg)
            except BadSample as exc:
                assert p.name in str(exc)
                continue
            assert x.shape == shape, (p.name, x.shape, shape)
            assert np.isfinite(x).all()
