"""Preference records (tessel.data.preference) and the DPO loss (tessel.train.dpo) on their own;
against TRL itself in tests/integration/test_dpo_trl.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tessel.data.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from tessel.data.preference import extract_prompt, read_pairs, to_record
from tessel.data.sft import chat_encoder
from tessel.data.tokenizer import train_bpe
from tessel.errors import DataError
from tessel.train.dpo import PairStats, pair_losses, row_logps, split_pairs, step_loss

EOS = "<|im_end|>"
TEMPLATE = ChatTemplate(BUILTIN_TEMPLATES["chatml"], "chatml", eos_token=EOS)


@pytest.fixture(scope="module")
def hf():
    texts = ["Which letter comes after q? After q comes r. Maybe s. Spell sun: S-U-N"] * 20
    return chat_encoder(train_bpe(texts, 320, special_tokens=("<|im_start|>", EOS)))


def _write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_implicit_prompts_are_the_shared_beginning():
    assert extract_prompt("Q? Yes.", "Q? No.") == ("Q?", " Yes.", " No.")
    user = {"role": "user", "content": "Q?"}
    a, b = {"role": "assistant", "content": "Yes."}, {"role": "assistant", "content": "No."}
    rec = to_record({"chosen": [user, a], "rejected": [user, b]}, "x:1")
    assert (rec.prompt, rec.chosen, rec.rejected, rec.chat) == ([user], [a], [b], True)
    # a text prompt beside conversational replies is read as TRL reads it: extracted
    rec = to_record({"prompt": "Q?", "chosen": [user, a], "rejected": [user, b]}, "x:1")
    assert rec.prompt == [user]


def test_rows_learn_the_replies_only_and_count_what_is_left_out(hf, tmp_path: Path):
    user = [{"role": "user", "content": "Which letter comes after q?"}]
    good = {"prompt": user, "chosen": [{"role": "assistant", "content": "After q comes r."}],
            "rejected": [{"role": "assistant", "content": "Maybe s."}]}
    records = [good, {**good, "rejected": good["chosen"]},  # identical
               {**good, "chosen": [{"role": "assistant", "content": " "}]},  # empty
               {"prompt": "Spell sun:" * 30, "chosen": " S-U-N", "rejected": " sun"},  # too long
               {"prompt": "Spell sun:", "chosen": " S-U-N", "rejected": " sun"}]
    pairs, counts = read_pairs([_write(tmp_path / "p.jsonl", records)], TEMPLATE, hf, EOS, 48)
    assert (counts.records, counts.pairs, counts.identical, counts.empty, counts.long_prompt) == \
        (5, 2, 1, 1, 1)
    assert "1 with chosen equal to rejected" in counts.note()
    assert pairs.tokens.shape == (2, 2, 48)
    for i, rec in enumerate([good, records[-1]]):
        for j, key in enumerate(("chosen", "rejected")):
            learned = pairs.tokens[i, j][pairs.learned[i, j] == 1]
            text = hf.decode(learned.tolist(), skip_special_tokens=False)
            reply = rec[key] if isinstance(rec[key], str) else rec[key][0]["content"]
            # the reply and its end of turn (ChatML's newline after it too), nothing of the prompt
            assert text.strip() == f"{reply.strip()}{EOS}" or text == f"{reply}{EOS}\n", text


@pytest.mark.parametrize("records, words", [
    ([{"prompt": "a", "chosen": "b", "rejected": "b"}], "no preference pair is left"),
    ([{"prompt": "a", "chosen": "b"}], "not a preference record"),
    ([{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}],
     "both be text or both be lists"),
    ([{"prompt": [{"role": "wizard", "content": "a"}],
       "chosen": [{"role": "assistant", "content": "b"}],
       "rejected": [{"role": "assistant", "content": "c"}]}], "unknown role"),
])
def test_bad_preference_data_is_one_line(hf, tmp_path: Path, records: list, words: str):
    with pytest.raises(DataError) as err:
        read_pairs([_write(tmp_path / "p.jsonl", records)], TEMPLATE, hf, EOS, 48)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_losses_and_metrics_by_hand():
    policy = torch.tensor([[-3.0, -5.0], [-4.0, -2.0]])
    ref = torch.tensor([[-4.0, -4.0], [-4.0, -4.0]])
    counts = torch.tensor([[2, 4], [3, 1]])
    delta = torch.tensor([2.0, -2.0])
    sig = pair_losses(policy, ref, counts, "sigmoid", 0.1)
    torch.testing.assert_close(sig, -torch.nn.functional.logsigmoid(0.1 * delta))
    torch.testing.assert_close(pair_losses(policy, ref, counts, "hinge", 1.0),
                               torch.relu(1 - delta))
    ipo = pair_losses(policy, ref, counts, "ipo", 0.5)
    torch.testing.assert_close(ipo, torch.tensor([(0.5 + 0.25 - 1) ** 2, (0 - 2 - 1) ** 2]))
    assert math.isclose(float(pair_losses(policy, ref, counts, "robust", 0.1, 0.0).sum()),
                        float(sig.sum()), rel_tol=1e-6)  # no smoothing: DPO itself
    stats = PairStats()
    stats.add(policy, ref, 0.1)
    means = PairStats.means(stats.vector())
    assert means["rewards/accuracies"] == 0.5 and math.isclose(means["rewards/margins"], 0.0)
    assert means["logps/chosen"] == -3.5

    class S:
        loss, beta, label_smoothing, loss_weight, sft_weight = "sigmoid", 0.1, 0.0, 1.0, 0.5
    total = step_loss(policy, ref, counts, S, 2, 5.0)
    assert math.isclose(float(total), float(sig.mean()) + 0.5 * 7 / 5, rel_tol=1e-6)


def test_row_log_probs_count_the_learned_targets_only():
    logits = torch.randn(4, 6, 11)
    targets = torch.randint(0, 11, (4, 6))
    targets[:, :2] = -100
    logps, counts = row_logps(logits, targets)
    want = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(logps, (want * (targets != -100)).sum(1))
    assert counts.tolist() == [4] * 4 and split_pairs(logps).shape == (2, 2)


def test_parquet_files_and_hf_datasets_give_the_pairs_jsonl_gives(hf, tmp_path: Path):
    """Preference records in columns (Parquet; a Hugging Face `save_to_disk` directory, Arrow
    files, as TRL's datasets are shared) read as their JSONL: the same pairs, the same counts;
    a null reply or a damaged file is one line naming it."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def turn(role: str, text: str) -> list[dict[str, str]]:
        return [{"role": role, "content": text}]

    chats = [{"prompt": turn("user", f"Which letter comes after {c}?"),
              "chosen": turn("assistant", f"After {c} comes {chr(ord(c) + 1)}."),
              "rejected": turn("assistant", "Maybe s." if i % 3 else f"After {c} comes {c}.")}
             for i, c in enumerate("abcdefgh")]
    chats.append({**chats[0], "rejected": chats[0]["chosen"]})  # identical: counted, left out
    texts = [{"prompt": f"Spell {w}:", "chosen": f" {w.upper()}", "rejected": f" {w}"}
             for w in ("sun", "sea", "q")]
    for records in (chats, texts):
        want = read_pairs([_write(tmp_path / "p.jsonl", records)], TEMPLATE, hf, EOS, 48)
        pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
        datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
        for source in (tmp_path / "p.parquet", tmp_path / "ds"):
            pairs, counts = read_pairs([source], TEMPLATE, hf, EOS, 48)
            assert vars(counts) == vars(want[1]), source
            assert (pairs.tokens == want[0].tokens).all() and (pairs.learned == want[0].learned).all()
    pq.write_table(pa.Table.from_pylist([texts[0], {**texts[1], "chosen": None}]),
                   tmp_path / "null.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    for name, words in (("null.parquet", "null.parquet: row 1"), ("bad.parquet", "Parquet")):
        with pytest.raises(DataError) as err:
            read_pairs([tmp_path / name], TEMPLATE, hf, EOS, 48)
        assert words in str(err.value) and "\n" not in str(err.value), err.value
