"""Word statistics of plain text."""
