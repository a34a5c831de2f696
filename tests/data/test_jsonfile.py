"""A data file that is not UTF-8 text, or not JSON, is reported the one way of varpack.data.jsonfile --
``FILE:LINE: sample N: ...`` -- by every reader: `varpack plan` / `sft` / `check`, load_chat_data /
load_and_encode, the streaming reader, preference pairs, JSON (non-Lines) and parquet files."""

from __future__ import annotations

import gzip
import json
import re

import pytest

datasets = pytest.importorskip("datasets")

from varpack.cli.main import main  # noqa: E402
from varpack.data import load_and_encode  # noqa: E402
from varpack.data.chat import encode_dataset, load_chat_data  # noqa: E402
from varpack.data.multimodal import load_mm_rows  # noqa: E402
from varpack.data.preference import load_pairs  # noqa: E402
from varpack.data.stream import ChatStream, StreamingPackedDataset  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "Say it in French."}, {"role": "assistant", "content": "@"}]}
PAIR = {"prompt": "Say it in French.", "chosen": "@", "rejected": "no"}
#: line 2 of the file holds byte 0xe9 (latin-1 "é"), as a file saved in latin-1 does
NOT_UTF8 = r"FILE:2: sample 1: not UTF-8 text: byte 0xe9 at byte \d+ of the line \(invalid continuation byte\)"


def _lines(row, bad_line=2, n=3):
    """JSON Lines bytes of ``n`` copies of ``row``; on ``bad_line`` its "@" is the byte 0xe9 (else "e")."""
    out = []
    for lineno in range(1, n + 1):
        text = json.dumps(row).encode().replace(b"@", b"caf\xe9" if lineno == bad_line else b"cafe")
        out.append(text)
    return b"\n".join(out) + b"\n"


def _file(tmp_path, name, data):
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)
    return str(path)


def _match(path):
    return NOT_UTF8.replace("FILE", path.replace("\\", "\\\\").replace(".", r"\."))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def _never(*_a, **_k):
    raise AssertionError("the tokenizer is not needed to find a bad line")


@pytest.mark.parametrize("name", ["chats.jsonl", "chats.ndjson", "chats.jsonl.gz"])
def test_load_chat_data_and_load_and_encode_name_file_line_sample(tmp_path, tok, name):
    """load_chat_data accepted the file (datasets reads the bytes into Arrow strings) and encoding raised a bare
    UnicodeDecodeError from pyarrow; `varpack plan` (whose image-chat probe reads .jsonl first) said only
    "'utf-8' codec can't decode byte 0xe9 in position 139"."""
    path = _file(tmp_path, name, _lines(CHAT))
    with pytest.raises(ValueError, match=_match(path)):
        load_chat_data(path)
    with pytest.raises(ValueError, match=_match(path)):
        encode_dataset(path, tok)
    with pytest.raises(ValueError, match=_match(path)):
        load_and_encode([path], _never, formats=True)
    # negative control: the same file saved as UTF-8 loads
    good = _file(tmp_path, "good_" + name, _lines(CHAT).replace(b"caf\xe9", "café".encode()))
    assert len(load_chat_data(good)) == 3


def test_streaming_reader_names_file_line_sample(tmp_path, tok):
    """The streaming reader raised a bare UnicodeDecodeError."""
    path = _file(tmp_path, "chats.jsonl", _lines(CHAT))
    with pytest.raises(ValueError, match=_match(path)):
        list(ChatStream(path).rows())
    with pytest.raises(ValueError, match=_match(path)):
        list(StreamingPackedDataset(path, tok, packing_length=256, buffer_size=4))
    with pytest.raises(ValueError, match=_match(path)):  # the entry of `varpack sft --streaming`
        list(StreamingPackedDataset(load_and_encode([path], tok, streaming=True).samples, tok, packing_length=256))
    # the line numbers and sample ids count across files and skip blank lines
    first = _file(tmp_path, "first.jsonl", b"\n" + json.dumps(CHAT).encode() + b"\n")
    with pytest.raises(ValueError, match=_match(path).replace("sample 1", "sample 2")):
        list(ChatStream([first, path]).rows())


def test_preference_pairs_name_file_line_sample(tmp_path):
    path = _file(tmp_path, "pairs.jsonl", _lines(PAIR))
    with pytest.raises(ValueError, match=_match(path)):
        load_pairs(path)


def test_json_array_and_image_chat_reader_name_file_line(tmp_path):
    """A JSON array file: the document has no sample per line, so the line is named."""
    from varpack.data.jsonfile import read_rows

    rows = [json.dumps(CHAT).encode().replace(b"@", b"caf\xe9" if i == 1 else b"cafe") for i in range(3)]
    path = _file(tmp_path, "chats.json", b"[\n" + b",\n".join(rows) + b"\n]\n")  # the bad row is on line 3
    want = path.replace(".", r"\.") + r":3: not UTF-8 text: byte 0xe9"
    with pytest.raises(ValueError, match=want):
        load_chat_data(path)
    with pytest.raises(ValueError, match=want):
        load_mm_rows(path)
    with pytest.raises(ValueError, match=want):
        read_rows(path)


def test_parquet_names_file_row_sample(tmp_path):
    """A parquet file whose string holds bytes that are not UTF-8 (Arrow reads them unchecked)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.dumps(CHAT["messages"]).encode().replace(b"@", x) for x in (b"cafe", b"caf\xe9", b"cafe")]
    binary = pa.array(texts, pa.binary())
    column = pa.Array.from_buffers(pa.string(), len(texts), binary.buffers())  # unchecked, as a writer may
    path = str(tmp_path / "chats.parquet")
    pq.write_table(pa.table({"text": column}), path)
    with pytest.raises(ValueError, match=path.replace(".", r"\.") + r" row 1: sample 1: not UTF-8 text"):
        load_chat_data(path)


def test_broken_json_is_named_the_same_way(tmp_path):
    """Broken JSON on the datasets path (.ndjson: not read by the image-chat probe) raised datasets' bare
    DatasetGenerationError; every reader now names it as the bad byte above."""
    good = json.dumps(CHAT).encode().replace(b"@", b"cafe")
    data = good + b"\n" + good[:-3] + b"\n" + good + b"\n"
    for name in ("chats.ndjson", "chats.jsonl"):
        path = _file(tmp_path, name, data)
        want = path.replace(".", r"\.") + r":2: sample 1: invalid JSON: Expecting"
        with pytest.raises(ValueError, match=want):
            load_chat_data(path)
        with pytest.raises(ValueError, match=want):
            list(ChatStream(path).rows())
        with pytest.raises(ValueError, match=want):
            load_mm_rows(path)


def test_rows_that_are_not_objects_name_the_file_as_written(tmp_path, monkeypatch, capsys, caplog):
    """A JSON Lines row that is a list: the error named the resolved absolute path (the file read again
    by json after datasets failed) and followed datasets' own ERROR record "Failed to load JSON from file"."""
    good = json.dumps(CHAT)
    (tmp_path / "notobj.jsonl").write_text(good + "\n[1, 2]\n" + good + "\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("ERROR"), pytest.raises(ValueError) as exc:
        load_chat_data("notobj.jsonl")
    assert str(exc.value) == "notobj.jsonl:2: sample 1: a chat row must be a JSON object, got list"
    assert not [r for r in caplog.records if "Failed to load JSON" in r.getMessage()]
    assert main(["plan", "notobj.jsonl"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"varpack plan: error: {exc.value}" and "Failed to load JSON" not in err
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/notobj.jsonl:2: sample 1")):  # an absolute path
        load_chat_data(str(tmp_path / "notobj.jsonl"))


@pytest.mark.parametrize("command", ["plan", "sft", "check"])
def test_cli_names_file_line_sample(tmp_path, capsys, command):
    """`varpack plan FILE` exited 1 with "'utf-8' codec can't decode byte 0xe9 in position 139" only."""
    path = _file(tmp_path, "chats.jsonl", _lines(CHAT))
    argv = {
        "plan": ["plan", path],
        "sft": ["sft", "--model", "tiny-qwen3", "--data", path, "--max-steps", "1", "--no-save",
                "--output-dir", str(tmp_path / "out")],
        "check": ["check", "--model", "tiny-qwen3", "--data", path],
    }[command]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"varpack {command}: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(_match(path), err), err


@pytest.mark.parametrize("name", ["chats.jsonl", "chats.ndjson", "chats.jsonl.gz", "chats.json"])
def test_byte_order_mark_is_skipped(tmp_path, tok, name):
    """A file saved with a UTF-8 byte order mark (EF BB BF, as Windows editors and utf-8-sig write it): its
    first line failed as "invalid JSON: Unexpected UTF-8 BOM"."""
    rows = [CHAT, {"messages": [{"role": "user", "content": "Name it."}, {"role": "assistant", "content": "é"}]}]
    if name.endswith(".json"):
        body = json.dumps(rows).encode()
    else:
        body = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    path = _file(tmp_path, name, b"\xef\xbb\xbf" + body)
    from varpack.data.jsonfile import read_rows

    assert [r for r, _ in read_rows(path)] == rows
    assert list(load_chat_data(path)["messages"]) == [r["messages"] for r in rows]
    assert [r for r, _ in load_mm_rows(path)] == rows
    data = load_and_encode([path], tok, formats=True)
    assert data.formats == {"messages": 2} and len(data.samples) == 2
    assert data.samples[0]["input_ids"] == encode_dataset([CHAT], tok)[0]["input_ids"]
    if not name.endswith(".json"):
        assert [dict(r) for _, r in ChatStream(path).rows()] == rows
        packs = list(StreamingPackedDataset(path, tok, packing_length=256, buffer_size=4))
        assert sorted(s["sample_id"] for p in packs for s in p) == [0, 1]
