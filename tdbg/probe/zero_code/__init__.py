"""``tdbg run``'s in-process side: the preload and model/optimizer discovery."""
