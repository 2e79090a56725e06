"""Canned SQL queries, one .sql file per query."""
