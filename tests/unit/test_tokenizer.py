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
