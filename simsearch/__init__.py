"""The `simsearch` command: every stage's commands under one name (`simsearch.cli`)."""
