"""What both gradient views share: the layers that pass the name filter typed after ``/``."""

from __future__ import annotations


class LayerFilter:
    """Mixed into a gradient view that lists ``_names`` and shows ``_rows`` (the indices that
    match ``name_filter``); ``_rebuild`` recomputes the rows and what is drawn from them."""

    name_filter: str
    _names: list[str]
    _rows: list[int]

    @property
    def total(self) -> int:
        return len(self._names)

    @property
    def matched(self) -> int:
        return len(self._rows)

    def filter(self, query: str) -> None:
        """Show only the layers whose name matches ``query`` (the heatmap's scale refits to
        them; the table matches a layer's model name too)."""
        if query != self.name_filter:
            self.name_filter = query
            self._rebuild()

    def _rebuild(self) -> None:
        raise NotImplementedError
