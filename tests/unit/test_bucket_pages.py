"""``store.pages`` as a bucket URL (config.py, objstore/pages.py) without a server: the
URL checked in one line, URLs told from directories, and the page names a bucket listing
gives parsed (fuzzed: they come from the network)."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs import config
from kspeedfs.config import StoreConfig
from kspeedfs.errors import ConfigError
from kspeedfs.manifest.pages import page_name, parse_page_name


@pytest.mark.parametrize("value, why", [
    ("s3://Bad_Bucket/pages", "is not an S3 bucket name"),
    ("ftp://host/pages", "is not an s3://, gs:// or az://BUCKET/PREFIX URL"),
    ("file://relative/dir", "is not file:///ABSOLUTE/DIR"),
])
def test_a_bad_store_pages_url_is_one_config_error(value: str, why: str) -> None:
    with pytest.raises(ConfigError, match="store.pages") as e:
        config.load(environ={}, overrides={"store.pages": value})
    assert why in str(e.value) and "\n" not in str(e.value)


def test_store_pages_urls_and_directories_are_told_apart() -> None:
    assert StoreConfig(pages="s3://b-1/p").pages_url() == "s3://b-1/p"
    assert StoreConfig(pages="file:///srv/pages").pages_dir() == "/srv/pages"
    assert StoreConfig(pages="file:///srv/pages").pages_url() is None
    assert StoreConfig(pages="/srv/pages").pages_dir() == "/srv/pages"
    assert StoreConfig(pages="gs://b-1/p").pages_dir() == ""


def test_a_page_name_parses_back_to_its_hash() -> None:
    digest = hashlib.sha256(b"page").digest()
    assert parse_page_name(page_name(digest)) == digest
    h = digest.hex()
    for other in (h, f"{h[:2]}/{h}.tmp", f"{h[2:4]}/{h}", f"{h[:2]}/{h.upper()}", f"x/{h[:2]}/{h}",
                  f"{h[:2]}/{h[:-1]}g"):
        assert parse_page_name(other) is None, other


@given(st.one_of(st.text(max_size=80), st.binary(min_size=32, max_size=32).map(
    lambda d: page_name(d)[:-1] + "A"), st.from_regex(r"[0-9a-f]{2}/[0-9a-fA-F\- ]{62,66}", fullmatch=True)))
def test_fuzz_parse_page_name_gives_a_hash_only_for_its_own_name(name: str) -> None:
    digest = parse_page_name(name)
    assert digest is None or page_name(digest) == name
