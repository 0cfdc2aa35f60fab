import json

import pytest

from rhymerl.config import DataConfig
from rhymerl.data import DatasetError, EpochSampler, load_records

pytestmark = pytest.mark.cpu


def test_reasoning_gym_is_fixed_by_seed():
    cfg = DataConfig(tasks=["basic_arithmetic", "chain_sum"], size=8, seed=3)
    a, b = load_records(cfg), load_records(cfg)
    assert [r.prompt for r in a] == [r.prompt for r in b] and len(a) == 8
    assert all(r.reward == "reasoning_gym" and r.metadata["task"] in cfg.tasks for r in a)
    c = load_records(DataConfig(tasks=["basic_arithmetic", "chain_sum"], size=8, seed=4))
    assert [r.prompt for r in c] != [r.prompt for r in a]


def test_jsonl_schema_errors_name_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"p\.jsonl:2: missing 'answer'"):
        load_records(DataConfig(source="jsonl", path=str(f)))
    f.write_text('{"prompt": "a", "answer": 1}\n{bad json\n')
    with pytest.raises(DatasetError, match=r"p\.jsonl:2: not valid JSON"):
        load_records(DataConfig(source="jsonl", path=str(f)))
    f.write_text("\n\n")
    with pytest.raises(DatasetError, match="empty"):
        load_records(DataConfig(source="jsonl", path=str(f)))
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 3, "metadata": {"a": 1}}) + "\n")
    (r,) = load_records(DataConfig(source="jsonl", path=str(f)))
    assert r.answer == "3" and r.metadata == {"a": 1} and r.id == "p:1"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?"], "answer": ["1", "2"]}), f)
    recs = load_records(DataConfig(source="parquet", path=str(f)))
    assert [r.answer for r in recs] == ["1", "2"]
    pq.write_table(pa.table({"prompt": ["a?"], "gold": ["1"]}), f)
    with pytest.raises(DatasetError, match="row 1: missing 'answer'"):
        load_records(DataConfig(source="parquet", path=str(f)))


def test_sampler_revisits_and_resumes_exactly():
    s = EpochSampler(10, 4, seed=1)
    assert s.steps_per_epoch == 2
    seen = [s.next_batch() for _ in range(6)]
    assert [b.epoch for b in seen] == [0, 0, 1, 1, 2, 2]
    assert len(set(seen[0].indices + seen[1].indices)) == 8
    ref = EpochSampler(10, 4, seed=1)
    ref_batches = [ref.next_batch().indices for _ in range(6)]
    # Resume at the epoch boundary (a classic off-by-one in other trainers).
    t = EpochSampler(10, 4, seed=1)
    t.next_batch(); t.next_batch()
    state = t.state_dict()
    u = EpochSampler(10, 4, seed=1)
    u.load_state_dict(state)
    assert [u.next_batch().indices for _ in range(4)] == ref_batches[2:]
    with pytest.raises(ValueError, match="batch_size"):
        EpochSampler(10, 5, seed=1).load_state_dict(state)


def test_sampler_next_epoch():
    s = EpochSampler(6, 3, seed=0)
    assert s.next_epoch == 0
    s.next_batch()
    assert s.next_epoch == 0
    s.next_batch()
    assert s.next_epoch == 1
    assert s.next_batch().epoch == 1


def test_answer_format_sets_the_instruction_the_prompt_ends_with():
    from rhymerl.config import DataConfig
    from rhymerl.data import PromptRecord
    from rhymerl.data.prompts import messages_for

    rec = PromptRecord(id="q", prompt="What is 2 + 3?", answer="5")
    shot = PromptRecord(id="s", prompt="What is 1 + 1?", answer="2")
    final = messages_for(rec, [shot], DataConfig(answer_format="final_only"))
    assert final[-1]["content"] == "What is 2 + 3? Give only the final answer." and final[1]["content"] == "2"
    steps = messages_for(rec, [shot], DataConfig(answer_format="step_by_step"))
    assert steps[-1]["content"].startswith("What is 2 + 3? Solve it step by step")
    assert "only the final answer" not in steps[-1]["content"] and steps[1]["content"] == "Answer: 2"
    assert messages_for(rec, [], DataConfig(answer_format="none"))[-1]["content"] == "What is 2 + 3?"
    # Chat-message prompts carry their own instruction.
    chat = PromptRecord(id="c", prompt=[{"role": "user", "content": "hi"}], answer="x")
    assert messages_for(chat, [], DataConfig(answer_format="step_by_step")) == [{"role": "user", "content": "hi"}]
