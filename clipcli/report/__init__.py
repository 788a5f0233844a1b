"""The report of each command as a frozen object, rendered by its type as a table, JSON or CSV.

`rows` holds the rows the reports share; `listing` (inspect, convert), `norms` (global-norm), `clip` (the clip
commands) and `diff` one report type each; `render` the escaping, table, JSON and CSV primitives they use.
Nothing is imported here: a run imports the one report module its command needs.
"""
