"""Browsing a view (issue 37: views are accepted everywhere a manifest is): the pages, samples,
search and index statistics are the view's samples, through the data layer and over HTTP."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from tarshards import Manifest, View
from tarshards.web import BrowseData, serve

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def view(dataset, tmp_path_factory):
    m = Manifest.load(dataset[0])
    keep = [i for i in range(m.num_samples) if i % 3 == 1 or i == 7]  # 7: the evil key
    return View.from_positions(m, keep).save(str(tmp_path_factory.mktemp("bv") / "v.view.json"))


def test_browse_data_pages_the_views_samples(dataset, view):
    made = dataset[2]
    picked = [made[i] for i in view.global_rows()]
    with BrowseData(view.url) as data:
        assert data.view is not None and len(data) == len(view) == len(picked)
        assert data.spec == view.url
        for i in (0, 5, len(picked) - 1):
            info = data.info(i)
            assert info.key == picked[i]["__key__"]
            assert data.field_bytes(i, "bin") == picked[i]["bin"]
            assert data.read(i)["txt"] == picked[i]["txt"]
        _page, pages, rows = data.page(1, 10)
        assert pages == -(-len(picked) // 10) and list(rows) == list(range(10, 20))
        total, found = data.search("img00", limit=100)
        want = [i for i, s in enumerate(picked) if s["__key__"].startswith("img00")]
        assert total == len(want) and found == want
        stats = data.index_stats()
        assert stats["samples"] == len(picked)
        assert sum(stats["samples_per_shard"]) == len(picked)
        assert stats["fields"]["bin"]["count"] == len(picked)
        assert stats["fields"]["bin"]["bytes"] == sum(len(s["bin"]) for s in picked)
        assert stats["fields"].get("seg.png") is None  # only sample 11 has it, not in the view
        assert sum(int(v) for v in stats["members_per_sample"].values()) == len(picked)


def test_browse_a_view_over_http(dataset, view):
    made = dataset[2]
    picked = [made[i] for i in view.global_rows()]
    with serve(view, page_size=8) as srv:
        with urllib.request.urlopen(srv.url + "api/info", timeout=30) as r:
            info = json.loads(r.read())
        assert info["samples"] == len(picked) and info["view"] is True
        assert info["fingerprint"] == view.fingerprint
        with urllib.request.urlopen(srv.url + "api/page?page=1&size=8", timeout=30) as r:
            page = json.loads(r.read())
        assert [s["key"] for s in page["samples"]] == [s["__key__"] for s in picked[8:16]]
        with urllib.request.urlopen(srv.url + "api/sample/3/bin", timeout=30) as r:
            assert r.read() == picked[3]["bin"]
        with urllib.request.urlopen(srv.url + "api/stats", timeout=30) as r:
            assert r.status == 200


def test_a_view_of_a_manifest_without_indexes_is_refused(dataset, tmp_path):
    m = Manifest.load(dataset[0])
    bare = Manifest.from_counts(m.shard_urls(), [r.samples for r in m.shards])
    bare = bare.save(str(tmp_path / "bare.json"))
    v = View.from_positions(bare, np.arange(0, 120, 2))
    with pytest.raises(ValueError, match="index"):
        BrowseData(v)
