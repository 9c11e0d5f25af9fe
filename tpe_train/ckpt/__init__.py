"""Everything a run keeps on disk (see the modules)."""
