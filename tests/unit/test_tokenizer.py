import base64
import json

import pytest

from tessel.data.tokenizer import TokenizerError, byte_tokenizer, load_tokenizer, train_bpe


def test_byte_ids_are_the_utf8_bytes_and_eod_is_256():
    tok = byte_tokenizer()
    text = "héllo\n\tdef main(): 日本"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert (tok.eod_id, tok.vocab_size) == (256, 257)
    assert tok.decode(tok.encode(text) + [tok.eod_id]) == text


def test_text_spelling_a_special_token_stays_text(tmp_path):
    bpe = train_bpe(["the cat sat on the mat. " * 50] * 10, vocab_size=300)
    bpe.save(tmp_path / "tok.json")
    for tok in (byte_tokenizer(), bpe, load_tokenizer(tmp_path / "tok.json")):
        text = "a doc about <|endoftext|> tokens"
        ids = tok.encode(text)
        assert tok.eod_id not in ids and tok.decode(ids) == text


def test_fingerprint_survives_save_and_load_and_tells_tokenizers_apart(tmp_path):
    bpe = train_bpe(["alpha beta gamma delta " * 40] * 5, vocab_size=280)
    bpe.save(tmp_path / "a.json")
    assert load_tokenizer(tmp_path / "a.json").fingerprint() == bpe.fingerprint()
    assert bpe.fingerprint() != byte_tokenizer().fingerprint()


@pytest.mark.parametrize(("spec", "needle"), [
    ("nope.json", "neither 'bytes'"),
    ("gpt2-files:only-one", "must be gpt2-files:VOCAB.json,MERGES.txt"),
    ("gpt2-files:a.json,b.txt", "does not exist"),
])
def test_bad_specs_are_one_line_errors(spec, needle):
    with pytest.raises(TokenizerError, match=needle):
        load_tokenizer(spec)


# ---- what the post-processor adds, the end-of-document token, the vocabulary size ---------

def _llama3_style(tmp_path, single: str = "<|begin_of_text|> $A"):
    """A byte-level BPE with Llama 3's special tokens and its BOS-adding template."""
    from tokenizers import processors

    tok = train_bpe(["the cat sat on the mat. " * 50] * 10, vocab_size=300).hf
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    ids = {t: tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>")}
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, i) for t, i in ids.items() if t in single])
    out = tmp_path / "llama3"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>"}))
    return out, ids


def test_the_post_processor_adds_bos_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    out, ids = _llama3_style(tmp_path)
    tok = load_tokenizer(out / "tokenizer.json")
    ref = AutoTokenizer.from_pretrained(str(out))
    for text in ("the cat sat", "mat. the\n\tcat", "", "日本 x"):  # (special-token text: see above)
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.encode_batch([text, text]) == [ref(text)["input_ids"]] * 2
    assert tok.encode("the")[0] == ids["<|begin_of_text|>"]
    tok = load_tokenizer(out / "tokenizer.json", eod_token="<|end_of_text|>")
    assert tok.eod_id == ids["<|end_of_text|>"]
    assert tok.decode(tok.encode("the cat") + [tok.eod_id]) == "the cat"
    assert tok.template() == "adds <|begin_of_text|> before each document"
    # GPT-2-style tokenizers (ByteLevel post-processor or none) keep their bare ids
    assert byte_tokenizer().template() == "adds nothing"


def test_a_document_is_ended_once_when_the_template_already_ends_it(tmp_path):
    from tessel.data.indexed import IndexedDataset
    from tessel.data.preprocess import preprocess

    out, ids = _llama3_style(tmp_path, "<|begin_of_text|> $A <|end_of_text|>")
    (tmp_path / "d.txt").write_text("the cat")
    tok = load_tokenizer(out / "tokenizer.json", eod_token="<|end_of_text|>")
    preprocess([tmp_path / "d.txt"], tok, tmp_path / "ds",
               append_eod=True, progress=False)
    doc = IndexedDataset(tmp_path / "ds").document(0).tolist()
    assert doc[0] == ids["<|begin_of_text|>"] and doc[-1] == ids["<|end_of_text|>"]
    assert doc.count(ids["<|end_of_text|>"]) == 1


def test_eod_token_names_a_token_of_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    hf = HF(models.WordLevel({"a": 0, "b": 1, "<pad>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    hf.add_special_tokens(["<pad>"])
    hf.save(str(tmp_path / "t.json"))
    auto = load_tokenizer(tmp_path / "t.json")  # none of the known names: one is added
    assert (auto.eod_id, auto.vocab_size) == (4, 5)
    chosen = load_tokenizer(tmp_path / "t.json", eod_token="<pad>")
    assert (chosen.eod_id, chosen.vocab_size) == (2, 4)
    with pytest.raises(TokenizerError, match="data.eod_token='</s>' is not a token"):
        load_tokenizer(tmp_path / "t.json", eod_token="</s>")


def test_truncation_in_a_tokenizer_json_never_cuts_a_document(tmp_path):
    bpe = train_bpe(["alpha beta gamma delta " * 40] * 5, vocab_size=280).hf
    bpe.enable_truncation(4)
    bpe.save(str(tmp_path / "t.json"))
    assert len(load_tokenizer(tmp_path / "t.json").encode("alpha beta gamma delta " * 3)) > 4


# ---- tiktoken encodings from a local file, against tiktoken itself ---------------------------

def _ranks_file(path, vocab: int = 400) -> dict[bytes, int]:
    """A genuine byte-level BPE ranking (a trained BPE's merge order) as a .tiktoken file."""
    from tessel.data.byte_level import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    hf = train_bpe([TEXT] * 4, vocab_size=vocab).hf
    ranks = {bytes(byte_of[c] for c in t): i for t, i in hf.get_vocab(with_added_tokens=False).items()
             if t != "<|endoftext|>"}
    ranks = {t: r for r, t in enumerate(sorted(ranks, key=ranks.get))}
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


TEXT = ("The quick brown fox's tale: don't WE'LL 12345 6789, CamelCase ALLCAPS.\r\n\n\t  x "
        "Ünïcödé naïve café 日本語のテキスト 😀 <|endoftext|> ") * 3


@pytest.mark.parametrize("name", ["r50k_base", "cl100k_base", "o200k_base"])
def test_tiktoken_encodings_give_tiktokens_ids(tmp_path, name):
    tiktoken = pytest.importorskip("tiktoken")
    from tessel.data.tiktoken_file import ENCODINGS

    ranks = _ranks_file(tmp_path / f"{name}.tiktoken")
    enc = ENCODINGS[name]
    ref = tiktoken.Encoding(f"test-{name}", pat_str=enc.pattern, mergeable_ranks=ranks,
                            special_tokens=enc.specials)
    tok = load_tokenizer(f"tiktoken:{tmp_path / f'{name}.tiktoken'}")
    for text in (TEXT, "x", "  \n\n  end  ", "ÀÉÎ 中文 😀 emoji's", "a1234567b"):
        assert tok.encode(text) == ref.encode_ordinary(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.eod_id == enc.specials["<|endoftext|>"]
    assert tok.vocab_size == max(enc.specials.values()) + 1  # ids past the gap are counted
    # the named form and tiktoken's own cache directory find the same encoding
    same = load_tokenizer(f"tiktoken:{name}={tmp_path / f'{name}.tiktoken'}")
    assert same.fingerprint() == tok.fingerprint()


def test_tiktoken_cache_directory_is_where_tiktoken_keeps_the_file(tmp_path, monkeypatch):
    import hashlib

    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerError, match="never downloads"):
        load_tokenizer("tiktoken:cl100k_base")
    _ranks_file(tmp_path / hashlib.sha1(url.encode()).hexdigest())
    assert load_tokenizer("tiktoken:cl100k_base").eod_id == 100257


@pytest.mark.parametrize(("content", "needle"), [
    ("IQ== 0\nnot-base64!! 1\n", ":2: not a tiktoken line"),
    ("IQ== 0\nIQ== 1\n", "listed twice"),
    ("IQ== 0\nIg== 2\n", "ranks are not 0..1"),
    ("IQ== 0\n", "byte 0 has no token"),
])
def test_damaged_tiktoken_files_are_refused(tmp_path, content, needle):
    (tmp_path / "cl100k_base.tiktoken").write_text(content)
    with pytest.raises(TokenizerError, match=needle):
        load_tokenizer(f"tiktoken:{tmp_path / 'cl100k_base.tiktoken'}")


def test_unknown_tiktoken_encoding_names_the_known_ones(tmp_path):
    _ranks_file(tmp_path / "mine.tiktoken")
    with pytest.raises(TokenizerError, match="unknown encoding 'mine'.*tiktoken:NAME=PATH"):
        load_tokenizer(f"tiktoken:{tmp_path / 'mine.tiktoken'}")


def test_the_caller_stays_awake_while_a_bpe_trains():
    """The BPE trained in the caller's thread, in native code, where no signal handler runs:
    SIGTERM while preparing data and Ctrl-C waited for the end of the training (27-41 s on
    17 MB). Here the caller stops it (as a signal handler raising would) while the documents
    are still coming; the training thread, abandoned, ends when they stop."""
    import threading
    import time

    class Stop(Exception):
        pass

    fed = threading.Event()

    def documents():
        while not fed.is_set():  # as many as it takes: the training cannot end by itself
            yield "the quick brown fox jumps over the lazy dog " * 8

    def waiting():
        fed.set()
        raise Stop

    with pytest.raises(Stop):
        train_bpe(documents(), 300, waiting=waiting)
    deadline = time.monotonic() + 60  # (generous: only the documents already read are left)
    while any(t.name == "tessel-bpe-training" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the abandoned training never ended"
        time.sleep(0.05)
