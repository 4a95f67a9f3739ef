"""The libjpeg-turbo a Pillow wheel bundles, found by globbing Pillow's files
(``images._pillow_libjpeg``): only reported by ``jpeg_decoder()`` where Pillow decodes (loading it
into the C decoder was weighed and removed, issue 36 item 7). The glob breaks when Pillow changes
its layout; every way it can break gives ``None`` or a path, never an exception, and decoding is
not touched."""

from __future__ import annotations

import io
import os

import numpy as np
import PIL
import pytest
from PIL import Image

from tarshards.codecs import images


def _fake_pillow(tmp_path, monkeypatch, libs: dict) -> str:
    """A Pillow laid out at ``tmp_path`` (``PIL/__init__.py``, ``pillow.libs/``)."""
    (tmp_path / "PIL").mkdir()
    (tmp_path / "PIL" / "__init__.py").write_text("")
    (tmp_path / "pillow.libs").mkdir()
    for name, content in libs.items():
        if content is None:
            (tmp_path / "pillow.libs" / name).mkdir()
        else:
            (tmp_path / "pillow.libs" / name).write_bytes(content)
    monkeypatch.setattr(PIL, "__file__", str(tmp_path / "PIL" / "__init__.py"))
    return str(tmp_path / "pillow.libs")


def test_no_bundled_library_gives_none(tmp_path, monkeypatch):
    _fake_pillow(tmp_path, monkeypatch, {"libpng16.so.16": b"\x7fELF"})
    assert images._pillow_libjpeg() is None


def test_a_pillow_without_a_file_gives_none(monkeypatch):
    monkeypatch.setattr(PIL, "__file__", None)  # a namespace package, a frozen build
    assert images._pillow_libjpeg() is None


def test_a_directory_named_like_the_library_is_not_taken(tmp_path, monkeypatch):
    libs = _fake_pillow(tmp_path, monkeypatch, {"libjpeg-abc.so.62": None})
    assert images._pillow_libjpeg() is None
    (tmp_path / "pillow.libs" / "libjpeg-def.so.62").write_bytes(b"not a library")
    assert images._pillow_libjpeg() == os.path.join(libs, "libjpeg-def.so.62")


def test_the_wrong_library_is_reported_without_a_version_and_pillow_decodes(tmp_path, monkeypatch):
    """Where Pillow decodes (no C decoder, no simplejpeg) and the glob finds a file that is not
    libjpeg-turbo (another library, garbage): no crash, no version, and the pixels come out."""
    libs = _fake_pillow(tmp_path, monkeypatch, {"libjpeg-x.so.62": b"\x7fELF garbage"})
    monkeypatch.setattr(images, "_cjpeg", lambda: None)
    monkeypatch.setattr(images, "_simplejpeg", lambda: None)
    assert images.jpeg_decoder() == {
        "decoder": "Pillow",
        "libjpeg": os.path.join(libs, "libjpeg-x.so.62"),
        "libjpeg_turbo": None,
    }
    monkeypatch.setattr(images, "_pillow_libjpeg", lambda: None)
    assert images.jpeg_decoder() == {"decoder": "Pillow", "libjpeg": None, "libjpeg_turbo": None}
    pixels = np.random.default_rng(0).integers(0, 255, (16, 24, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=95)
    got = images.image_decoder("rgb8")(buf.getvalue(), "jpg")
    assert got.shape == (16, 24, 3) and got.dtype == np.uint8


def test_the_real_layout_names_a_libjpeg_turbo_or_nothing():
    found = images._pillow_libjpeg()
    if found is None:
        pytest.skip("this Pillow ships no libjpeg of its own (built against the system's)")
    assert os.path.isfile(found) and images._turbo_version(found) is not None
