"""Data sources: the builtin corpus, text files/globs/folders, JSONL, Hugging Face datasets (local only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kubetrain.config import SourceConfig
from kubetrain.data import sources
from kubetrain.errors import DataError


def src(kind: str, path: Path | str | None = None, **kw: object) -> SourceConfig:
    return SourceConfig.model_validate({"kind": kind, "path": str(path) if path is not None else None, **kw})


def test_builtin_corpus_is_shipped_small_and_named() -> None:
    path = sources.builtin_corpus_path()
    assert path.is_file()
    assert 100_000 < path.stat().st_size <= 2 * 1024 * 1024
    readme = (path.parent / "README.md").read_text(encoding="utf-8")
    assert "public domain" in readme.lower()
    docs = list(sources.iter_documents(src("builtin")))
    assert len(docs) == 1 and "In the beginning God created" in docs[0]


def test_text_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    assert list(sources.iter_documents(src("text", tmp_path / "a.txt"))) == ["hello\n"]


def test_text_glob_is_sorted_and_recursive(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "sub" / "c.txt").write_text("C")
    (tmp_path / "skip.md").write_text("no")
    assert list(sources.iter_documents(src("text", tmp_path / "*.txt"))) == ["A", "B"]
    assert list(sources.iter_documents(src("text", tmp_path / "**" / "*.txt"))) == ["A", "B", "C"]


def test_text_folder_reads_every_visible_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "z.txt").write_text("Z")
    (tmp_path / "sub" / "y.md").write_text("Y")
    (tmp_path / ".hidden").write_text("H")
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "ab").write_bytes(b"\x78\x9c\xff binary")
    files = sources.source_files(src("text", tmp_path))
    assert [f.name for f in files] == ["y.md", "z.txt"]


@pytest.mark.parametrize("kind", ["text", "auto"])
def test_a_link_that_leads_nowhere_is_named_for_what_it_is(tmp_path: Path, kind: str) -> None:
    """A symbolic link loop or a dangling link exists as a name: "not found" sends the user looking for a typo."""
    loop = tmp_path / "loop.txt"
    loop.symlink_to(loop)
    with pytest.raises(DataError) as e:
        sources.resolve_kind(src(kind, loop)) if kind == "auto" else sources.source_files(src(kind, loop))
    assert str(e.value) == f"data path is a symbolic link loop: {loop}"
    dangling = tmp_path / "gone.txt"
    dangling.symlink_to(tmp_path / "moved.txt")
    with pytest.raises(DataError, match=r"symbolic link to .*moved\.txt, which is not there"):
        sources.source_files(src("text", dangling))


def test_missing_path_empty_glob_and_empty_folder_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data path not found: .*nope\.txt"):
        sources.source_files(src("text", tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="no files match data path"):
        sources.source_files(src("text", tmp_path / "*.none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="data folder is empty"):
        sources.source_files(src("text", tmp_path / "empty"))


def test_non_utf8_text_names_the_file_and_offset(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text \(invalid byte at offset 3\)"):
        list(sources.iter_documents(src("text", tmp_path / "latin1.txt")))


def test_jsonl_text_field(tmp_path: Path) -> None:
    rows = [{"text": "one", "id": 1}, {"text": "two"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert list(sources.iter_documents(src("jsonl", tmp_path / "d.jsonl"))) == ["one", "two"]
    (tmp_path / "e.jsonl").write_text(json.dumps({"body": "three"}) + "\n")
    assert list(sources.iter_documents(src("jsonl", tmp_path / "e.jsonl", text_field="body"))) == ["three"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": \n', r"d\.jsonl:2: not valid JSON"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', r"d\.jsonl:3: no 'text' field"),
        ('{"text": 5}\n', r"d\.jsonl:1: field 'text' is not a string"),
        ('["text"]\n', r"d\.jsonl:1: no 'text' field"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        list(sources.iter_documents(src("jsonl", tmp_path / "d.jsonl")))


def test_fingerprint_follows_bytes_and_settings(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one")
    first = sources.fingerprint(src("text", f))
    assert sources.fingerprint(src("text", f)) == first
    assert sources.fingerprint(src("text", f, weight=2)) != first
    f.write_text("two")
    assert sources.fingerprint(src("text", f)) != first


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the datasets cache in the test's folder and stay offline."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets = sys.modules.get("datasets")
    if datasets is not None:  # already imported: it read the variable then
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return tmp_path


def test_hf_dataset_saved_to_disk(hf_cache: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["alpha", "beta"], "n": [1, 2]}).save_to_disk(str(hf_cache / "ds"))
    assert list(sources.iter_documents(src("hf", hf_cache / "ds"))) == ["alpha", "beta"]


def test_hf_dataset_dict_picks_the_split(hf_cache: Path) -> None:
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"content": ["t1", "t2"]}),
        "test": datasets.Dataset.from_dict({"content": ["e1"]}),
    })
    dd.save_to_disk(str(hf_cache / "dd"))
    got = list(sources.iter_documents(src("hf", hf_cache / "dd", split="test", text_field="content")))
    assert got == ["e1"]
    with pytest.raises(DataError, match="rows need a string field 'text'"):
        list(sources.iter_documents(src("hf", hf_cache / "dd")))


def test_hf_dataset_from_a_local_jsonl_file(hf_cache: Path) -> None:
    pytest.importorskip("datasets")
    f = hf_cache / "rows.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["x1", "x2", "x3"]))
    assert list(sources.iter_documents(src("hf", f))) == ["x1", "x2", "x3"]


def test_hf_local_file_is_part_of_the_fingerprint(hf_cache: Path) -> None:
    f = hf_cache / "rows.jsonl"
    f.write_text(json.dumps({"text": "a"}) + "\n")
    first = sources.fingerprint(src("hf", f))
    f.write_text(json.dumps({"text": "b"}) + "\n")
    assert sources.fingerprint(src("hf", f)) != first


def test_hf_dataset_errors_are_one_line(hf_cache: Path) -> None:
    pytest.importorskip("datasets")
    odd = hf_cache / "rows.xyz"
    odd.write_text("x")
    with pytest.raises(DataError, match="cannot tell the dataset format"):
        list(sources.iter_documents(src("hf", odd)))
    with pytest.raises(DataError, match="could not be loaded") as e:
        list(sources.iter_documents(src("hf", "no-such-org/no-such-dataset-kubetrain")))
    assert "\n" not in str(e.value)


def test_chat_sources_are_not_plain_documents(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="holds conversations"):
        list(sources.iter_documents(src("chat", tmp_path / "c.jsonl")))


def test_kind_is_told_from_text_jsonl_and_chat_files(tmp_path: Path) -> None:
    (tmp_path / "my.txt").write_text("plain words\n", encoding="utf-8")
    (tmp_path / "notes").write_text("no suffix at all\n", encoding="utf-8")
    (tmp_path / "docs.jsonl").write_text("\n" + json.dumps({"text": "a doc"}) + "\n", encoding="utf-8")
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "a doc"}) + "\n", encoding="utf-8")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "pr.json").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    assert sources.resolve_kind(src("auto", tmp_path / "my.txt")).kind == "text"
    assert sources.resolve_kind(src("auto", tmp_path / "notes")).kind == "text"
    assert sources.resolve_kind(src("auto", tmp_path / "docs.jsonl")).kind == "jsonl"
    assert sources.resolve_kind(src("auto", tmp_path / "body.jsonl", text_field="body")).kind == "jsonl"
    assert sources.resolve_kind(src("auto", tmp_path / "chat.jsonl")).kind == "chat"
    assert sources.resolve_kind(src("auto", tmp_path / "pr.json")).kind == "chat"
    assert sources.resolve_kind(src("auto")).kind == "builtin"
    # A given kind is kept as it is.
    assert sources.resolve_kind(src("text", tmp_path / "docs.jsonl")).kind == "text"
    # Documents of an auto source are those of the kind it resolves to.
    assert list(sources.iter_documents(src("auto", tmp_path / "docs.jsonl"))) == ["a doc"]


def test_kind_of_a_save_to_disk_folder_is_hf(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    (tmp_path / "ds" / "data-00000-of-00001.arrow").write_bytes(b"\xff\x00binary")
    assert sources.resolve_kind(src("auto", tmp_path / "ds")).kind == "hf"


def test_kind_of_a_folder_or_glob_of_one_kind(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "b.md").write_text("B")
    assert sources.resolve_kind(src("auto", tmp_path)).kind == "text"
    assert sources.resolve_kind(src("auto", tmp_path / "*.txt")).kind == "text"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("blob.bin", b"\x00\xff\xfe" * 100, r"cannot tell what data .*blob\.bin holds: not UTF-8 text"),
        ("rows.jsonl", b'{"id": 1}\n', r"rows\.jsonl holds: its first line is not a JSON object with "
                                        r"'messages', 'prompt'/'response' or 'text'; set the source's kind"),
        ("array.json", b'[{"text": "a"}]\n', r"array\.json holds"),
    ],
)
def test_unclear_files_are_refused_with_one_line(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message):
        sources.resolve_kind(src("auto", tmp_path / name))


def test_mixed_kinds_and_missing_paths_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "B"}) + "\n")
    with pytest.raises(DataError, match=r"mixes kinds of data \(jsonl: b\.jsonl, text: a\.txt\)"):
        sources.resolve_kind(src("auto", tmp_path))
    with pytest.raises(DataError, match=r"data path not found: user/dataset \(a Hugging Face dataset id "
                                        r"needs kind: hf\)"):
        sources.resolve_kind(src("auto", "user/dataset"))
