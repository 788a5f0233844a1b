"""What each command does, on open checkpoints: one module per command, with its typed options and gates.

`select` (which tensors, which rows), `passes` (the one runner of a pass over chunks), `measure` (norms),
`write` (the one writer), `gates` (what the gates share); then `inspect`, `global_norm`, `clip` (the three
clip commands), `convert` and `diff`. Nothing is imported here: a run imports the command module it needs.
"""
