"""The native chunk fetch: peer READs that the FUSE engine's C posts, verifies and
answers, with Python deciding every load. ``fetch.py`` (NativeFetch, the seam) maps the
package; docs/design.md, "The native fetch, step by step", walks its flows."""
