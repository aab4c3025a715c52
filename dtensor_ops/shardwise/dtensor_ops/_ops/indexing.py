"""Indexing ops: slicing, select, narrow, index_select, gather, scatter, advanced indexing, masked_fill, where."""
