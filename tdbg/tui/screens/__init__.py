"""Screens of the tdbg monitor: the monitor itself, help, run picker and waiting."""
