"""GSM8K through the tfds builder: real files, cache reuse and invalidation, clear errors."""

import json

import pytest

from logra_jax.data import load_gsm8k
from logra_jax.data.gsm8k import parse_gsm8k_line
from logra_jax.data.answers import normalize_answer


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def record(question, final):
    return {"question": question, "answer": f"Some work <<1+1=2>>2\n#### {final}"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds_cache")


def test_real_test_split_matches_the_jsonl_line_by_line(gsm8k_dir, cache_dir):
    source = load_gsm8k(gsm8k_dir, "test", cache_dir=cache_dir)
    lines = (gsm8k_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(source) == len(lines) == 1319
    for i, line in enumerate(lines):
        raw = json.loads(line)
        example = source[i]
        assert example["question"] == raw["question"].strip()
        assert example["answer"] == normalize_answer(raw["answer"].split("####")[-1])
        assert "," not in example["answer"]
    with pytest.raises(IndexError):
        source[len(source)]


def test_train_split_is_prepared_alongside(gsm8k_dir, cache_dir):
    source = load_gsm8k(gsm8k_dir, "train", cache_dir=cache_dir)
    assert len(source) == 7473
    first = json.loads((gsm8k_dir / "train.jsonl").open(encoding="utf-8").readline())
    assert source[0]["question"] == first["question"].strip()


def test_prepared_copy_is_reused_and_refreshed_when_files_change(tmp_path):
    data_dir, cache = tmp_path / "gsm8k", tmp_path / "cache"
    data_dir.mkdir()
    write_jsonl(data_dir / "test.jsonl", [record("What is 1+1?", "2"), record("Big?", "1,200")])
    first = load_gsm8k(data_dir, "test", cache_dir=cache)
    assert [first[i]["answer"] for i in range(2)] == ["2", "1200"]
    prepared = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    assert load_gsm8k(data_dir, "test", cache_dir=cache)[1]["answer"] == "1200"
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == prepared

    write_jsonl(data_dir / "test.jsonl", [record("Changed?", "7")])
    changed = load_gsm8k(data_dir, "test", cache_dir=cache)
    assert len(changed) == 1 and changed[0] == {"question": "Changed?", "answer": "7"}


def test_missing_directory_and_missing_split_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gsm8k(tmp_path / "nowhere", "test", cache_dir=tmp_path / "cache")
    write_jsonl(tmp_path / "train.jsonl", [record("q", "1")])
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl not found.*\['train'\]"):
        load_gsm8k(tmp_path, "test", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("bad_line, match", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "JSON object"),
    ('{"question": "q"}', "'answer'"),
    ('{"question": "", "answer": "#### 3"}', "'question'"),
    ('{"question": "q", "answer": "no marker 3"}', "####"),
    ('{"question": "q", "answer": "work ####   "}', "nothing after"),
])
def test_malformed_line_reports_file_and_line(tmp_path, bad_line, match):
    data_dir = tmp_path / "gsm8k"
    data_dir.mkdir()
    good = json.dumps(record("What is 1+1?", "2"))
    # Line 4, after a blank line 2 that is skipped but still counted.
    (data_dir / "test.jsonl").write_text(f"{good}\n\n{good}\n{bad_line}\n{good}\n", encoding="utf-8")
    path = data_dir / "test.jsonl"
    with pytest.raises(ValueError, match=match) as err:
        load_gsm8k(data_dir, "test", cache_dir=tmp_path / "cache")
    assert f"{path}:4:" in str(err.value)


def test_parse_line_strips_and_normalises():
    example = parse_gsm8k_line(json.dumps(record("  Cost?  ", "$1,234")), "f.jsonl", 1)
    assert example == {"question": "Cost?", "answer": "1234"}
