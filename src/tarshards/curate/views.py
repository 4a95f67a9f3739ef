"""Views of a data set (issue 37): :class:`View` (the record, defined with the manifest in
:mod:`tarshards.selection` so that every reader below the curation layer accepts it) and the
functions that make views: :func:`view` (filter), :func:`dedup`, :func:`split`."""

from __future__ import annotations

from ..selection import VIEW_SUFFIX, View, as_record, is_view_spec, load_record

__all__ = ["VIEW_SUFFIX", "View", "as_record", "is_view_spec", "load_record"]
