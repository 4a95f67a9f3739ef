from tarshards import WebDataset


def test_roundtrip_smoke(shards):
    paths, samples = shards
    got = list(WebDataset(paths))
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert all(g["jpg"] == s["jpg"] for g, s in zip(got, samples))
