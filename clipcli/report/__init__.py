"""The report of each command as a frozen object, rendered by its type as a table, JSON or CSV.

`rows` holds the rows the reports share; `listing` (inspect, convert), `norms` (global-norm), `clip` (the clip
commands) and `diff` one report type each; `render` the escaping, the table, JSON and CSV they share;
`progress` the progress bar on stderr. Nothing is imported here: a run imports the report module it needs.
"""
