"""Eager entry points per kernel family; `inductor_cute.ops` re-exports them."""
