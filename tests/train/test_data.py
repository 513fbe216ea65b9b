import csv
import json
import random
import string

import pytest

from tigon.train.config import SFTError
from tigon.train.data import read_file


def word(rng, n=6):
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def write(path, rows):
    """Rows in the file type its suffix names (csv cells holding lists as JSON)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, keys)
            writer.writeheader()
            for r in rows:
                writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    elif path.suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def chat_rows(rng, n):
    """n random two-turn chats (with a system turn) as (user1, reply1, user2, reply2, system)."""
    return [tuple(word(rng) for _ in range(5)) for _ in range(n)]


def as_format(fmt, c):
    u1, a1, u2, a2, system = c
    if fmt == "messages":
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": u1},
                             {"role": "assistant", "content": a1}, {"role": "user", "content": u2},
                             {"role": "assistant", "content": a2}]}
    if fmt == "sharegpt":
        return {"conversations": [{"from": "system", "value": system}, {"from": "human", "value": u1},
                                  {"from": "gpt", "value": a1}, {"from": "human", "value": u2},
                                  {"from": "gpt", "value": a2}]}
    if fmt == "query_response":
        return {"system": system, "history": [[u1, a1]], "query": u2, "response": a2}
    raise AssertionError(fmt)


def expected_chat(c):
    u1, a1, u2, a2, system = c
    return ({"role": "system", "content": system}, {"role": "user", "content": u1},
            {"role": "assistant", "content": a1}, {"role": "user", "content": u2},
            {"role": "assistant", "content": a2})


SUFFIXES = [".jsonl", ".json", ".csv", ".parquet"]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("fmt, name", [("messages", "OpenAI messages"), ("sharegpt", "ShareGPT conversations"),
                                       ("query_response", "query/response")])
def test_chat_formats(tmp_path, fmt, name, suffix):
    rng = random.Random()
    chats = chat_rows(rng, rng.randint(2, 6))
    path = write(tmp_path / f"data{suffix}", [as_format(fmt, c) for c in chats])
    samples, detected = read_file(str(path), seed=0)
    assert detected == name
    assert [s.messages for s in samples] == [expected_chat(c) for c in chats]
    assert all(s.text is None for s in samples)
    assert samples[0].where.startswith(str(path))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_alpaca_and_text(tmp_path, suffix):
    rng = random.Random()
    rows = [{"instruction": word(rng), "input": word(rng) if i % 2 else "", "output": word(rng)} for i in range(5)]
    samples, detected = read_file(str(write(tmp_path / f"alpaca{suffix}", rows)), seed=0)
    assert detected == "Alpaca"
    for row, s in zip(rows, samples):
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        assert s.messages == ({"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]})

    texts = [{"text": " ".join(word(rng) for _ in range(4))} for _ in range(3)]
    samples, detected = read_file(str(write(tmp_path / f"text{suffix}", texts)), seed=0)
    assert detected == "plain text"
    assert [s.text for s in samples] == [t["text"] for t in texts]


def test_openai_content_parts_and_json_lines_named_json(tmp_path):
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                        {"role": "assistant", "content": "c"}]}
    path = tmp_path / "lines.json"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    samples, _ = read_file(str(path), seed=0)
    assert len(samples) == 2 and samples[0].messages[0]["content"] == "ab"


def test_subsample_is_seeded_and_keeps_file_order(tmp_path):
    rows = [{"text": f"row {i}"} for i in range(50)]
    path = write(tmp_path / "t.jsonl", rows)
    a, _ = read_file(f"{path}#7", seed=1)
    b, _ = read_file(f"{path}#7", seed=1)
    c, _ = read_file(f"{path}#7", seed=2)
    numbers = [int(s.text.split()[1]) for s in a]
    assert len(a) == 7 and numbers == sorted(numbers)
    assert [s.text for s in a] == [s.text for s in b] != [s.text for s in c]


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "line 3: not valid JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}), "line 3: no assistant message with content"),
    (json.dumps({"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]}),
     "line 3: messages\\[0\\] has role 'wizard'"),
    (json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}),
     "line 3: messages\\[0\\] needs 'role' and 'content'"),
    (json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}),
     "line 3: messages\\[0\\].content must be a string, got int"),
    (json.dumps({"messages": []}), "line 3: messages must be a non-empty list"),
    (json.dumps({"text": "x"}), "line 3: missing messages \\(the file is OpenAI messages format\\)"),
    (json.dumps(["a"]), "line 3: expected an object, got list"),
])
def test_bad_row_names_file_line_and_problem(tmp_path, bad_line, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(SFTError, match=f"^{path} {message}"):
        read_file(str(path), seed=0)


ALPACA = {"instruction": "i", "output": "o"}
QUERY = {"query": "q", "response": "r"}


@pytest.mark.parametrize("first, row, message", [
    (ALPACA, {"instruction": "", "output": "x"}, "instruction is empty"),
    (ALPACA, {"instruction": "x", "output": None}, "output must be a string, got NoneType"),
    (QUERY, {**QUERY, "history": [["only one"]]}, "history\\[0\\] must be a \\[query, response\\] pair"),
    (QUERY, {**QUERY, "history": "no"}, "history is not valid JSON"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
     {"conversations": [{"from": "alien", "value": "x"}]}, "conversations\\[0\\] has from 'alien'"),
    ({"text": "t"}, {"text": "   "}, "text is empty"),
])
def test_bad_rows_of_other_formats(tmp_path, first, row, message):
    path = write(tmp_path / "d.json", [first, row])
    with pytest.raises(SFTError, match=f"{path} row 2: {message}"):
        read_file(str(path), seed=0)


def test_csv_bad_json_cell_and_extra_cells(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('query,response,history\nq,r,"[[""a"", ""b""]]"\nq,r,[oops\n')
    with pytest.raises(SFTError, match=f"{path} line 3: history is not valid JSON"):
        read_file(str(path), seed=0)
    path.write_text("text\nfine\nfine,extra\n")
    with pytest.raises(SFTError, match=f"{path} line 3: more cells than header columns"):
        read_file(str(path), seed=0)


@pytest.mark.parametrize("name, content, message", [
    ("d.jsonl", json.dumps({"prompt": "p", "completion": "c"}) + "\n",
     r"line 1: unknown data format \(keys \['completion', 'prompt'\]\)"),
    ("d.jsonl", "", "no rows"),
    ("d.json", json.dumps({"rows": []}), "expected a JSON list of rows, got dict"),
    ("d.txt", "hello", "unknown file type '.txt'"),
])
def test_bad_files(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SFTError, match=message):
        read_file(str(path), seed=0)


def test_missing_file_and_bad_subsample(tmp_path):
    with pytest.raises(SFTError, match="dataset file not found: .*nope.jsonl"):
        read_file(str(tmp_path / "nope.jsonl"), seed=0)
    path = write(tmp_path / "t.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(SFTError, match="asks for 3 rows but the file has 2"):
        read_file(f"{path}#3", seed=0)
    with pytest.raises(SFTError, match="the row count after # must be >= 1"):
        read_file(f"{path}#0", seed=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_byte_order_mark_of_spreadsheet_exports_is_read_past(tmp_path, suffix):
    rng = random.Random()
    rows = [{"instruction": word(rng), "output": word(rng) + " é ü 中"} for _ in range(3)]
    plain = write(tmp_path / f"plain{suffix}", rows)
    marked = tmp_path / f"marked{suffix}"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n"))
    (expected, fmt), (samples, marked_fmt) = read_file(str(plain), seed=0), read_file(str(marked), seed=0)
    assert fmt == marked_fmt == "Alpaca"
    assert [s.messages for s in samples] == [s.messages for s in expected]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_file_that_is_not_utf8_names_the_byte(tmp_path, suffix):
    rows = [{"instruction": "first", "output": "fine"}] * 3000 + [{"instruction": "cafe!", "output": "x"}]
    path = write(tmp_path / f"d{suffix}", rows)
    data = path.read_bytes().replace(b"cafe!", b"caf\xe9!")  # an é as latin-1 writes it
    path.write_bytes(data)
    where = data.index(b"caf\xe9") + 3
    line = data.count(b"\n", 0, where) + 1
    with pytest.raises(SFTError, match=f"^{path}: not UTF-8 text at byte {where} \\(line {line}\\): save it as UTF-8$"):
        read_file(str(path), seed=0)


def test_parquet_file_damaged_in_the_middle_is_one_line_naming_the_file_and_rows(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from tigon.cli import main

    rng = random.Random(0)
    words = [word(rng) for _ in range(8)]  # few words, so that snappy compresses the pages
    rows = [{"text": " ".join(rng.choice(words) for _ in range(40))} for _ in range(300)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="snappy")
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    middle = start + chunk.total_compressed_size // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(data)
    assert main(["sft", "--dataset", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon sft: error: {path} rows 101-200 (row group 2 of 3): cannot be read, the file is "
                          "damaged: ") and err.count("\n") == 1, err

    path.write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(SFTError, match=f"^{path}: not a readable parquet file: "):
        read_file(str(path), seed=0)
