"""Widgets of the tdbg monitor, one per module; each gets data through a ``show`` call."""
