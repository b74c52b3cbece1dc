"""Real data that ships in packages (see the README's "Data" notes)."""

from .spider import create_table_statements, load_spider, sql_prompt

__all__ = ["create_table_statements", "load_spider", "sql_prompt"]
