"""GSM8K from the user's own JSONL files, prepared once by a tfds builder and read without TensorFlow.

Each line of ``{data_dir}/{split}.jsonl`` is ``{"question": ..., "answer": ...}`` where the answer is
a worked solution ending in ``#### <final answer>`` (the format of openai/grade-school-math). The
builder keeps the question and the normalised final answer, writes array_record files
(``file_format="array_record"`` needs no TensorFlow) and ``as_data_source`` reads them back with
random access. Lines keep their file order, so example i is line i (blank lines skipped).

The prepared copy lives under ``cache_dir`` in a builder config named after a hash of the source
files, so editing or replacing the JSONL files triggers a fresh preparation instead of serving stale
data.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import tensorflow_datasets as tfds

from logra_jax.data.example import Example
from logra_jax.data.answers import normalize_answer

GOLD_MARKER = "####"


def parse_gsm8k_line(line: str, path: str | pathlib.Path, line_number: int) -> Example:
    """One GSM8K JSONL line → Example; a malformed line raises ValueError naming ``path:line``."""
    where = f"{path}:{line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with 'question' and 'answer', "
                         f"got {type(record).__name__}")
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise ValueError(f"{where}: field {key!r} is missing or not a non-empty string")
    if GOLD_MARKER not in record["answer"]:
        raise ValueError(f"{where}: answer has no {GOLD_MARKER!r} before the final answer")
    final = record["answer"].rsplit(GOLD_MARKER, 1)[1].strip()
    gold = normalize_answer(final)
    if not final or gold is None:
        raise ValueError(f"{where}: nothing after {GOLD_MARKER!r} in the answer")
    return Example(question=record["question"].strip(), answer=gold)


def read_gsm8k_jsonl(path: str | pathlib.Path):
    """Yield (line_number, Example) for every non-blank line of a GSM8K JSONL file; a line that
    is not UTF-8 raises ValueError naming ``path:line``."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{line_number}: not UTF-8 text ({err.reason} at byte "
                                 f"{err.start})") from None
            if line.strip():
                yield line_number, parse_gsm8k_line(line, path, line_number)


def _split_files(data_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """{split name: file} for every ``<split>.jsonl`` whose name tfds accepts as a split."""
    return {p.stem: p for p in sorted(data_dir.glob("*.jsonl")) if re.fullmatch(r"\w+", p.stem)}


def _fingerprint(files: dict[str, pathlib.Path]) -> str:
    digest = hashlib.sha256()
    for split, path in files.items():
        digest.update(split.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class LocalGsm8k(tfds.core.GeneratorBasedBuilder):
    """GSM8K prepared from local JSONL files (``dl_manager.manual_dir``): one split per file."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Question and normalised final answer from local GSM8K JSONL."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put GSM8K's train.jsonl / test.jsonl (from github.com/openai/grade-school-math) in one "
        "directory and pass it as data_dir to logra_jax.data.load_gsm8k.")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="GSM8K grade-school math word problems (local copy).",
            features=tfds.features.FeaturesDict({
                "question": tfds.features.Text(),
                "answer": tfds.features.Text(),
            }),
            homepage="https://github.com/openai/grade-school-math",
            disable_shuffling=True,  # keep file order: example i is line i
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        files = _split_files(pathlib.Path(dl_manager.manual_dir))
        return {split: self._generate_examples(path) for split, path in files.items()}

    def _generate_examples(self, path: pathlib.Path):
        for line_number, example in read_gsm8k_jsonl(path):
            yield line_number, example


class Gsm8kSource:
    """Random access to one prepared split, decoding tfds' bytes to an Example of str."""

    def __init__(self, data_source, name: str):
        self._data_source = data_source
        self.name = name

    def __len__(self) -> int:
        return len(self._data_source)

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: index {index} out of range [0, {len(self)})")
        record = self._data_source[index]
        return Example(question=record["question"].decode("utf-8"),
                       answer=record["answer"].decode("utf-8"))

    def __repr__(self) -> str:
        return f"Gsm8kSource({self.name}, {len(self)} examples)"


def load_gsm8k(data_dir: str | pathlib.Path, split: str, *,
               cache_dir: str | pathlib.Path | None = None) -> Gsm8kSource:
    """Random-access Examples of ``{data_dir}/{split}.jsonl``, prepared on first use.

    ``cache_dir`` is where tfds writes the array_record copy (tfds' default, ~/tensorflow_datasets,
    when None); later calls with unchanged files reuse it. Raises FileNotFoundError when the
    directory or the split file is missing, ValueError (with file:line) for a malformed line.
    """
    data_dir = pathlib.Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise FileNotFoundError(f"GSM8K data directory {data_dir} does not exist; point "
                                f"data.gsm8k_dir (launch.train's config; load_gsm8k's data_dir) "
                                f"at the folder holding train.jsonl / test.jsonl")
    files = _split_files(data_dir)
    if split not in files:
        raise FileNotFoundError(f"GSM8K split file {data_dir / (split + '.jsonl')} not found; "
                                f"available splits there: {sorted(files) or 'none'}")
    for name, file in files.items():  # tfds would fail on an empty split with a bare assertion
        with open(file, "rb") as f:   # bytes: a line that is not UTF-8 is named when it is read
            if not any(line.strip() for line in f):
                raise ValueError(f"GSM8K split file {file} holds no examples (it is empty); every "
                                 f"<split>.jsonl in {data_dir} needs at least one line")
    builder = LocalGsm8k(
        data_dir=None if cache_dir is None else str(pathlib.Path(cache_dir).expanduser()),
        config=tfds.core.BuilderConfig(name=f"src_{_fingerprint(files)}"),
        file_format="array_record",
    )
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(data_dir)))
    return Gsm8kSource(builder.as_data_source(split), name=f"gsm8k/{split}")
