"""The engine's expert cache: a pool of slots in HBM shared by every MoE layer and one policy class
per family behind one interface (docs/design.md §3)."""
