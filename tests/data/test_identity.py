"""The training data's identity: each file's size and content checksum, keyed by its path
relative to the data's directory, so a moved copy keeps it and an edit in place does not."""

import shutil

from meshtrain.config.data import MixtureSource
from meshtrain.config.schema import DataConfig
from meshtrain.data.identity import data_identity, describe_change
from meshtrain.data.prepare import prepare


def _chats(directory, n=3):
    directory.mkdir(parents=True)
    for i in range(n):
        (directory / f"{i}.jsonl").write_text('{"messages": []}\n' * (i + 1))
    (directory / "README.md").write_text("not records")
    return directory


def test_a_moved_copy_keeps_its_identity_and_an_edit_does_not(tmp_path):
    data = _chats(tmp_path / "chats")
    cfg = DataConfig(source="chat", paths=[str(data)])
    before = data_identity(cfg)
    assert sorted(before["data.paths"]) == ["0.jsonl", "1.jsonl", "2.jsonl"]  # records only
    assert before["data.paths"]["1.jsonl"][0] == 34  # bytes
    shutil.copytree(data, tmp_path / "elsewhere")
    assert data_identity(DataConfig(source="chat", paths=[str(tmp_path / "elsewhere")])) == before
    with open(data / "1.jsonl", "a") as f:
        f.write('{"messages": []}\n')
    (data / "0.jsonl").write_text('{"massages": []}\n')  # the same 17 bytes, other contents
    (data / "2.jsonl").unlink()
    (data / "3.jsonl").write_text("")
    after = data_identity(cfg)
    assert describe_change(before["data.paths"], after["data.paths"]) == (
        "0.jsonl: other contents, same 17 bytes; 1.jsonl: 34 → 51 bytes; 3.jsonl added and 1 more"
    )
    assert describe_change(after["data.paths"], after["data.paths"]) == ""


def test_every_key_that_names_training_data_is_recorded(tmp_path):
    a, b = _chats(tmp_path / "a", 1), _chats(tmp_path / "b", 2)
    mixture = DataConfig(
        source="chat",
        mixture=[MixtureSource(name="a", paths=[str(a)]), MixtureSource(name="b", paths=[str(b)])],
    )
    identity = data_identity(mixture)
    assert {k: sorted(v) for k, v in identity.items()} == {
        "data.mixture[0].paths": ["0.jsonl"],
        "data.mixture[1].paths": ["0.jsonl", "1.jsonl"],
    }
    assert data_identity(DataConfig(source="synthetic")) is None
    text = DataConfig(path=str(tmp_path / "a"), glob="*.md")
    assert list(data_identity(text)) == ["data.path"]
    assert list(data_identity(text)["data.path"]) == ["README.md"]


def test_a_prepared_directory_is_identified_by_its_manifest(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("some text " * 20)
    prepare([docs / "one.txt"], tmp_path / "prepared", root=docs)
    cfg = DataConfig(source="prepared", path=str(tmp_path / "prepared"))
    identity = data_identity(cfg)["data.path"]
    assert list(identity) == ["prepared/manifest.json"]
    manifest = tmp_path / "prepared" / "manifest.json"
    assert identity["prepared/manifest.json"][0] == manifest.stat().st_size
