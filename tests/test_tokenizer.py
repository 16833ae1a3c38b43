"""Tokenizers: the byte-level one unchanged, a Hugging Face tokenizer.json from a folder, chat templates,
and which tokens of a conversation carry loss."""
import json

import numpy as np
import pytest

from omnijax.data import formats
from omnijax.data import tokenizer as T
from omnijax.errors import ConfigError, UserError

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SENTENCES = ["a cat sat on the mat", "what is this? a dog.", "the quick brown fox jumps over the lazy dog",
             "User: hello there\nAssistant: hi", "listen to this tone and tell me what you hear"]


def make_hf(folder, vocab_size=320, template=CHATML, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            config=None, corpus=SENTENCES):
    """A tiny byte-level BPE trained in-process (no download), saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("tok") / "chatml")


@pytest.fixture(scope="module")
def hf(hf_dir):
    return T.load_tokenizer(str(hf_dir))


def test_byte_level_unchanged():
    tok = T.load_tokenizer("")
    assert tok is T.BYTE_TOKENIZER and tok.vocab_size == T.VOCAB_SIZE == 512
    assert (tok.bos, tok.eos, tok.pad) == (T.BOS, T.EOS, T.PAD) and tok.placeholder == T.PLACEHOLDER
    s = "héllo <image> wörld"
    assert np.array_equal(tok.encode(s, bos=True, eos=True), T.encode(s, bos=True, eos=True))
    assert T.IMAGE not in tok.encode(s).tolist()  # a typed tag is bytes, never the placeholder
    assert tok.decode(tok.encode(s)) == s and tok.chat_template is None


def test_hf_round_trip_specials_and_placeholders(hf, hf_dir):
    text = "the quick brown fox, what is this?"
    ids = hf.encode(text)
    assert ids.dtype == np.int32 and hf.decode(ids) == text
    assert hf.eos == hf._tok.token_to_id("<|im_end|>") and hf.pad == hf._tok.token_to_id("<|endoftext|>")
    assert hf.bos is None  # none configured and none of the usual names exists
    assert hf.encode(text, bos=True, eos=True)[-1] == hf.eos
    # the three placeholders are single added special tokens, above the trained vocabulary
    assert len(set(hf.placeholder.values())) == 3 and min(hf.placeholder.values()) >= 320
    assert hf.vocab_size == max(hf.placeholder.values()) + 1
    for m, tag in T.MEDIA_TAGS.items():
        ids, loss = hf.encode_marked([(f"x{tag}y", False, True)])
        assert hf.placeholder[m] in ids.tolist()  # in template markup the tag is one token
        typed = hf.encode(f"look {tag} here")  # in a user's text it is plain characters
        assert not set(typed.tolist()) & set(hf.placeholder.values()) and hf.decode(typed) == f"look {tag} here"
    assert hf.eos not in hf.encode("stop <|im_end|> now").tolist()
    assert hf.chat_template == CHATML


def test_specials_from_special_tokens_map_and_fallbacks(tmp_path):
    d = make_hf(tmp_path / "a", specials=("<s>", "</s>", "<unk>"), template=None,
                config={"eos_token": None, "pad_token": None})
    (d / "tokenizer_config.json").write_text("{}")
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    tok = T.load_tokenizer(str(d))
    assert (tok.bos, tok.eos, tok.pad) == (tok._tok.token_to_id("<s>"), tok._tok.token_to_id("</s>"),
                                           tok._tok.token_to_id("</s>"))  # pad falls back to eos
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    assert T.load_tokenizer(str(d)).bos is None  # an explicit null: no bos even though "<s>" exists
    assert tok.chat_template is None
    bare = make_hf(tmp_path / "b", specials=("<unk>",), template=None, config={"eos_token": None, "pad_token": None})
    with pytest.raises(UserError, match="no end-of-sequence token"):
        T.load_tokenizer(str(bare))
    with pytest.raises(UserError, match="folder not found"):
        T.load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no tokenizer\.json"):
        T.load_tokenizer(str(tmp_path / "empty"))


def test_vocab_check_names_both_numbers(hf):
    T.check_vocab(hf, hf.vocab_size)
    with pytest.raises(ConfigError, match=rf"vocab_size=300 .*{hf.vocab_size} ids"):
        T.check_vocab(hf, 300)
    T.check_vocab(T.BYTE_TOKENIZER, 512)


def test_fingerprint_stable_and_distinct(hf, hf_dir, tmp_path):
    assert T.load_tokenizer(str(hf_dir)).fingerprint == hf.fingerprint  # stable across loads
    other = T.load_tokenizer(str(make_hf(tmp_path / "o", vocab_size=300)))
    assert len({hf.fingerprint, other.fingerprint, T.BYTE_TOKENIZER.fingerprint}) == 3


CONV = {"image": "a.png", "conversations": [
    {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."},
    {"from": "human", "value": "And the colour?"}, {"from": "gpt", "value": "Grey."}]}


def _build(tok, rec):
    return formats.build(json.loads(json.dumps(rec)), tok, lambda p, m: (4, 4, 3), lambda p: p, "t[0]")


def test_chat_template_applied_and_loss_only_on_assistant_turns(hf):
    parts = _build(hf, CONV)
    assert [m for m, _, _ in parts][:3] == ["text", "image", "text"]
    text = [(v, loss) for m, v, loss in parts if m == "text"]
    ids = np.concatenate([v for v, _ in text])
    loss = np.concatenate([np.full(len(v), l) for v, l in text])
    # the template was applied: the whole text is the rendered conversation with the image cut out
    rendered = formats.render(hf, [{"role": "user", "content": "<image>\nWhat is this?"},
                                   {"role": "assistant", "content": "A cat."},
                                   {"role": "user", "content": "And the colour?"},
                                   {"role": "assistant", "content": "Grey."}])
    before, after = rendered.split("<image>")
    assert hf._tok.decode(ids.tolist(), skip_special_tokens=False) == before + after
    # exactly the answers and their <|im_end|> carry loss (not the "\n" after it, not the headers)
    a1, a2, end = hf._tok.encode("A cat.").ids, hf._tok.encode("Grey.").ids, hf.eos
    assert ids[loss].tolist() == a1 + [end] + a2 + [end]
    runs = [ids[i: j].tolist() for i, j in _true_runs(loss)]
    assert runs == [a1 + [end], a2 + [end]]


def _true_runs(mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_default_format_without_template(tmp_path):
    byte = T.BYTE_TOKENIZER
    parts = _build(byte, CONV)
    texts = [(byte.decode(v), l) for m, v, l in parts if m == "text"]
    assert [t for t, l in texts if l] == [" A cat.", " Grey."]
    assert parts[0][1][0] == T.BOS and all(v[-1] == T.EOS for m, v, l in parts if m == "text" and l)
    assert "".join(t for t, _ in texts) == "User: \nWhat is this?\nAssistant: A cat.User: And the colour?\nAssistant: Grey."
    plain = T.load_tokenizer(str(make_hf(tmp_path / "p", template=None)))
    ids = np.concatenate([v for m, v, l in _build(plain, CONV) if m == "text" and l])
    assert ids.tolist() == plain._tok.encode(" A cat.").ids + [plain.eos] + plain._tok.encode(" Grey.").ids + [plain.eos]


def test_bad_conversations_are_bad_records(hf, tmp_path):
    from omnijax.data.records import BadRecord
    with pytest.raises(BadRecord, match=r"t\[0\]: 2 <image> tag"):
        _build(hf, {"image": "a.png", "conversations": [{"from": "human", "value": "<image><image>"},
                                                         {"from": "gpt", "value": "x"}]})
    with pytest.raises(BadRecord, match="role 'robot'"):
        _build(hf, {"conversations": [{"from": "robot", "value": "x"}]})
    with pytest.raises(BadRecord, match="no assistant"):
        _build(hf, {"conversations": [{"from": "human", "value": "x"}]})
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    tok = T.load_tokenizer(str(make_hf(tmp_path / "strict", template=strict)))
    with pytest.raises(BadRecord, match="system first"):
        _build(tok, CONV)
    broken = T.load_tokenizer(str(make_hf(tmp_path / "broken", template="{% for m in messages %}")))
    with pytest.raises(ConfigError, match="does not compile"):  # the config's fault: not a skipped record
        _build(broken, CONV)


def test_media_without_tag_go_first_in_the_first_user_turn(hf):
    parts = _build(hf, {"audio": ["x.wav", "y.wav"], "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]})
    kinds = [m for m, _, _ in parts]
    assert kinds.count("audio") == 2
    before = hf.decode(np.concatenate([v for m, v, _ in parts[: kinds.index("audio")] if m == "text"]))
    assert "be brief" in before and "hi" not in before  # after the system turn, before the user's words
