"""mpp.specs: one spelling per set of shards, read from the text of a data spec."""
from __future__ import annotations

from mpp.specs import data_key, local_path, names_manifest


def test_a_one_item_list_is_its_item(tmp_path):
    """A pre-training given data.train=[MANIFEST] and fine-tunes given MANIFEST name one training
    set: the comparison withholds the development splits by this key, and pairs test sets by it."""
    manifest = f"{tmp_path}/data/train/manifest.json"
    assert data_key([manifest]) == data_key(manifest) == data_key(f"file:{tmp_path}/data/train")
    assert data_key([manifest, manifest]) != data_key(manifest)


def test_a_shard_compressed_or_not_names_no_manifest():
    """A single shard (.tar, .tar.gz, .tgz) or a pattern is no manifest: its count of samples is the
    run's data.val_num_samples, which tells two test sets of it apart."""
    for spec in ("d/000000.tar", "d/000000.tar.gz", "d/x.tgz", "d/{000000..000003}.tar", ["a.tar", "b.tar"]):
        assert not names_manifest(spec), spec
    for spec in ("d/val", "d/val/manifest.json", ["d/val"]):
        assert names_manifest(spec), spec


def test_file_urls_name_their_local_file():
    assert local_path("file:///a/b.tar") == "/a/b.tar" and local_path("file:a/b.tar") == "a/b.tar"
    assert local_path("/a/b.tar") == "/a/b.tar" and local_path("pipe:cat x") is None
