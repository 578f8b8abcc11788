"""Recording files: the format and reader, and the compaction that keeps them bounded."""
