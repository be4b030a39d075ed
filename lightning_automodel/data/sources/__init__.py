"""Where documents and records come from: text and JSONL files, Parquet and Arrow tables, ``datasets`` objects and
directories; each read a piece at a time, with where each piece is (line, byte or row) for error messages."""
